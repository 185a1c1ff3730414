"""Run configuration presets (YAML files loaded by ``rlax_tasks.config.load_config``)."""
