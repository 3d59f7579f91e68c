/*
 * The C ghost record's state (ghost.c: the ring and the table; ghost_type.c: the Python type).
 */
#ifndef KVR_GHOST_H
#define KVR_GHOST_H

#include "kvr.h"

typedef struct {
    PyObject *key; /* owned; NULL: a dead slot */
    Py_hash_t hash;
    long long boundary;
    int gid;
    uint32_t tag; /* mix(hash, gid): the key's home in the table and its quick filter */
} ghost_slot;

/* A table entry: the slot's tag (high 32 bits) and its index in the ring, so probing and the
 * deletion's shifting read no ring slot but the one that matches. */
typedef uint64_t ghost_entry;

typedef struct {
    PyObject_HEAD
    Py_ssize_t num_groups, capacity, size;
    ghost_slot *ring;
    size_t ring_mask;
    long long head, tail; /* absolute positions: the slots head..tail-1 are in use */
    ghost_entry *table;
    size_t table_mask;
} Ghost;

#define SLOT(g, pos) ((g)->ring[(size_t)(pos) & (g)->ring_mask])

int ghost_group_of(Ghost *g, PyObject *o, int *out);
int ghost_add_one(Ghost *g, int gid, PyObject *key, long long boundary);
int ghost_discard_one(Ghost *g, int gid, PyObject *key);
int ghost_has(Ghost *g, int gid, PyObject *key);
void ghost_trim(Ghost *g);
void ghost_drop_all(Ghost *g);
int ghost_table_rebuild(Ghost *g, Py_ssize_t want);

#endif /* KVR_GHOST_H */
