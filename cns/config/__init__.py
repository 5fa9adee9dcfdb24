"""The daemon's configuration: its YAML file, read strictly, every error naming its key."""
