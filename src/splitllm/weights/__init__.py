"""Where a model's weights come from and how they are kept: packaged models, sources, conversions."""
