"""The PostgreSQL adapter: local cluster manager, pool, migrations, named queries, stores."""
