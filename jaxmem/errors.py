"""The error a bad configuration value raises (a flag, a config key, a config.json field): its
message names the value; the command-line tools print it on one line and exit 2."""


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""
