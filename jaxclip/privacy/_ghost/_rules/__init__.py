"""The ghost engine's rules: each site's per-example squared norm, one file per rule."""
