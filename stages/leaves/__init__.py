"""The leaf modules: each imports none of ours (config, tags, rendering, tensors, ...), so any
module may import them."""
