"""The Environment service: environments, bindings, the init-once guard,
registered files, output directories and the organization file store."""
