"""The appliance: a governed, cost-capped work bus for AI agents on PostgreSQL."""
