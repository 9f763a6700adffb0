-- The machinery's role may read which migrations the database has, so that a command or a
-- runner started against a database older (or newer) than its code says so and what to run,
-- instead of failing later on a relation or function it does not find (appliance.db.migrate,
-- schema_problem). Versions, names and checksums only: nothing of any tenant's.
GRANT SELECT ON schema_migrations TO appliance_system;
