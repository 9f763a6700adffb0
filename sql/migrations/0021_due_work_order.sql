-- Deferred work (0020) is ordered by when it comes due, in two places.
--
-- 1. The promoter took due work oldest-due first across lanes, a bounded batch at a time:
--    behind a burst of batch work scheduled for one moment (a nightly job of 100,000
--    messages), interactive work that came due a second later waited until the burst had been
--    promoted, ten batches a tick. It now reads the deferred rows lane by lane, interactive
--    first, each lane oldest-due first, within one batch: interactive work due now is in the
--    first batch of every tick, whatever the other lanes hold.
DROP INDEX agent_messages_deferred_not_before_idx;
CREATE INDEX agent_messages_deferred_lane_not_before_idx ON agent_messages (lane, not_before)
    WHERE status = 'pending' AND deferred;

-- 2. A lane's maximum queue age counted from the message's creation: work enqueued for later
--    than the lane's maximum age (an interactive message scheduled two hours ahead, a one-hour
--    limit) was expired before it ever came due. The age now counts from when the work became
--    due: greatest(created_at, not_before), which is the creation for work enqueued to run now,
--    and the end of the backoff for a retry.
DROP INDEX agent_messages_lane_created_at_idx;
CREATE INDEX agent_messages_lane_due_at_idx ON agent_messages (lane, greatest(created_at, not_before))
    WHERE status = 'pending';
