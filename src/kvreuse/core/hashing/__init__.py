"""Chained prefix hashing (spec section 5), one responsibility a module; a request's tokens
take one path down through them:

    hasher    Hasher: one configuration's root and UnitTemplate; a new chain per request
    chain     UnitTemplate, Chain (kvreuse's encoding) and CborChain (vLLM's): H[k] per
              request, extended as tokens arrive
    keys      the extra keys of spec 5.2 (LoRA, multimodal items, salt), validated and ordered
    digests   the digest D per algorithm (its package imported only when chosen), the seeds,
              the root H[0]
    cbor      vLLM's sha256_cbor: canonical CBOR and vLLM's rules for a block's hash

Nothing is imported here: a module is imported by its own name and loads only what it uses.
"""
