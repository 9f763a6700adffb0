-- Deferred work is promoted lane by lane, in claim order.
--
-- The promoter (0020) took due work oldest-due first across lanes, a bounded batch at a time:
-- behind a burst of batch work scheduled for one moment (a nightly job of 100,000 messages),
-- interactive work that came due a second later waited until the burst had been promoted,
-- ten batches a tick. The promoter now reads the deferred rows lane by lane, interactive first,
-- each lane oldest-due first, within one batch: interactive work due now is in the first batch
-- of every tick, whatever the other lanes hold.

DROP INDEX agent_messages_deferred_not_before_idx;
CREATE INDEX agent_messages_deferred_lane_not_before_idx ON agent_messages (lane, not_before)
    WHERE status = 'pending' AND deferred;
