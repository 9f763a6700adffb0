-- The transition log is keyed by message: (message_id, id).
--
-- Every transition was written into three indexes: the primary key on id, (message_id, id) (how
-- the log is read: one message's history, archiving and pruning by message) and the partial
-- index of reclaims. Nothing reads a transition by its id alone, so (message_id, id), unique as
-- well, is the primary key now and the index on id alone is gone: one index entry fewer for
-- every transition, three for a message enqueued, claimed and completed (of the index entries
-- written per message, WAL by record type: 2 of an enqueue's 6, 4 of the 8 of a claim and its
-- completion were the log's).
ALTER TABLE message_transitions DROP CONSTRAINT message_transitions_pkey;
ALTER TABLE message_transitions
    ADD CONSTRAINT message_transitions_pkey PRIMARY KEY (message_id, id);
DROP INDEX message_transitions_message_id_idx;
