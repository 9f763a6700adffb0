"""Pure domain model of the work bus: envelope, states, lanes, leases, retry, ports. No I/O."""
