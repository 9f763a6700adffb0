"""The work bus as an application: enqueue, claim, lease, complete, retry, maintenance steps."""
