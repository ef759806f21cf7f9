"""The weights service: holds the latest version in host memory and pushes it to every instance."""
