"""Model families, the default tiny model and the code that loads weights into a model."""
