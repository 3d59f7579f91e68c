"""Memory tiers below the device pool (docs/tiers.md), one responsibility a module, each
importing only those above it in this list:

    spec      what a tier is: TierSpec (name, capacity, medium), Admission per group kind
    ops       what the engine is handed: Demote, Move, Load (TierOp), each with its keys
    tier      one tier: its slots, per-group index and LRU order (Tier)
    stack     the tiers below one pool (TierStack): where evicted and published blocks go, the
              ops decided and not yet taken, whose turn a shared tier is
    shared    a tier several managers share (SharedTier) and its copies in other processes
    view      a lookup across the pool and its tiers (TierView: virtual block ids)
    loads     the loads of a hit, held until their step commits (TierLoads), and their faults

Nothing is imported here: a module is imported by its own name and loads only what it uses.
"""
