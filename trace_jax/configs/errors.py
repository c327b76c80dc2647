"""The error a config can cause: a key or value that is not allowed, a config file that fails to build."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config the user can fix; its message is one line naming the key and what is allowed.

    The commands exit with status 2 for it (``trace_jax.job.cli.ExitCode.CONFIG``)."""

    exit_code = 2
