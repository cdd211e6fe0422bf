"""Tree paths as text, one way for every part (the sharding rules, the quantizer's selection,
the frozen base's records): 'layers/self_attn/q_proj' for a tuple of keys or a jax KeyPath."""

from __future__ import annotations


def key_name(key) -> str | None:
    """The string a path entry names (a dict key or an attribute), None for an index."""
    if isinstance(key, str):
        return key
    for attr in ("key", "name"):  # DictKey / FlattenedIndexKey .key, GetAttrKey .name
        value = getattr(key, attr, None)
        if isinstance(value, str):
            return value
    return None


def in_layers(path) -> bool:
    """True for a leaf of the scanned decoder stack ('layers' among its keys), whose first axis
    (when it has more than one) is the layer axis L."""
    return "layers" in path_text(path).split("/")


def path_text(path) -> str:
    """'layers/self_attn/q_proj' for a tuple of keys or a KeyPath."""
    def text(key):
        name = key_name(key)
        return name if name is not None else str(getattr(key, "idx", getattr(key, "key", key)))
    return "/".join(text(k) for k in path)
