"""Pointers for DeepEP V1 normal-mode names that epcomm does not offer (docs/porting.md maps each onto the V2.5
calls): code ported from V1 gets an error that says where its call went instead of Python's bare one."""

# The package's names.
MODULE = {
    "Buffer": "use epcomm.EPBuffer(group, num_max_tokens_per_rank=N, hidden=H, num_topk=K), which sizes itself",
    "Config": "pass num_sms= to each dispatch/combine; there are no chunk sizes to tune",
}

# EPBuffer's methods.
BUFFER = {
    "get_dispatch_layout": "dispatch(x, topk_idx, topk_weights, num_experts=E) computes the layout inside the call",
    "get_dispatch_config": "pass num_sms= to each call; there are no chunk sizes to tune",
    "get_combine_config": "pass num_sms= to each call; there are no chunk sizes to tune",
    "set_num_sms": "pass num_sms= to each call (default: the handle's, or get_theoretical_num_sms)",
    "intranode_dispatch": "call dispatch: one call for every transport",
    "intranode_combine": "call combine: one call for every transport",
    "internode_dispatch": "call dispatch: one call for every transport",
    "internode_combine": "call combine: one call for every transport",
}


def missing(owner: str, name: str, table: dict) -> AttributeError:
    """AttributeError for `owner.name`, with the V1 pointer when `name` is one of DeepEP V1's."""
    message = f"{owner} has no attribute {name!r}"
    if name in table:
        message += f": DeepEP V1's normal-mode {name} is not offered; {table[name]} (docs/porting.md)"
    return AttributeError(message)
