"""Errors the appliance reports: each names the field or resource that is wrong."""

from __future__ import annotations


class ApplianceError(Exception):
    """Base of every error the appliance raises on purpose (the CLI prints it without a trace)."""


class InvalidInput(ApplianceError):
    """Input that breaks a rule: names the field, what is wrong and, where one exists, the limit."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class UnknownTenant(InvalidInput):
    """A tenant name that is not registered (`appliance tenant add NAME` registers one)."""

    def __init__(self, tenant: str) -> None:
        super().__init__(
            "tenant",
            f"unknown tenant {tenant!r} (register it with `appliance tenant add {tenant}`)",
        )
        self.tenant = tenant


class NotFound(ApplianceError):
    """A message (or other resource) that does not exist or is not visible to this tenant."""


class ConfigurationError(ApplianceError):
    """The appliance is configured in a way it cannot run with; the message says what to change."""


class ClusterError(ApplianceError):
    """The local PostgreSQL cluster could not be found, created, started or stopped."""


class MigrationError(ApplianceError):
    """Migrations cannot be applied: a changed applied file, a database newer than the code, ..."""


class DatabaseUnavailable(ApplianceError):
    """The database cannot be reached (not started, not migrated, wrong address)."""


class RowBusy(ApplianceError):
    """A row the statement had to write stayed locked by another session past the lock
    timeout: the same write may succeed later (nothing was written)."""


class RunnerIdInUse(ConfigurationError):
    """A runner id that another live runner holds: two runners under one id would each take
    the other's stages for its own."""

    def __init__(self, runner_id: str, problem: str) -> None:
        super().__init__(
            f"runner id {runner_id!r} {problem}: give this runner another id (runner.id, "
            "APPLIANCE_RUNNER__ID) or stop the other"
        )
        self.runner_id = runner_id
