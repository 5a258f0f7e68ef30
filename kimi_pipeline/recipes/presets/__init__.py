"""The shipped recipe presets, one YAML file each (`_`-prefixed: bases only), read by `recipes.load`."""
