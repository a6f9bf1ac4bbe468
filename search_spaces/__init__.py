"""Search spaces as YAML data, their loader and validation, and hardware-aware rules."""
