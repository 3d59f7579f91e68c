/*
 * kvreuse.core._native: optional C kernels for the core's per-unit and per-block hot paths.
 *
 * Every kernel implements one method of a pure-Python owner (hashing.Chain in chain.c,
 * policy.LRUPolicy in queue.c, pool.BlockPool in pool.c and publish.c) on that owner's own
 * state, changed in place exactly as the Python method would change it: the LRU's arrays are
 * passed in, the pool's are bound once by name in a BlockTable (table.c). One owner is a type instead: Ghost (ghost.c, ghost_type.c) is ghost.GhostRecord
 * with the same interface, its state kept in C. The pure-Python code is the reference;
 * tests/core/test_native*.py compare the two.
 * SHA-256 comes from the libcrypto that hashlib loaded, else portable code (sha256.c).
 *
 * KVR_SOURCE_SHA256 (set by setup.py) is the digest of the sources in this folder at build time:
 * the loader (native.py) recomputes it, so a stale build never shadows an edited source.
 */
#include "kvr.h"

#ifndef KVR_SOURCE_SHA256
#define KVR_SOURCE_SHA256 "unknown"
#endif

/* publish.c: BlockPool.publish's per-entry loop and BlockPool.release's counting and queueing */
PyObject *kvr_publish_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *kvr_release_refs(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

static PyMethodDef methods[] = {
    {"sha256", kvr_sha256_digest, METH_VARARGS, "sha256(data, portable=False) -> bytes"},
    {"sha256_units", (PyCFunction)(void (*)(void))kvr_sha256_units, METH_FASTCALL,
     "sha256_units(parent, pre, mid, la_hdr, tail, tokens, first, num_units, unit, lookahead"
     "[, portable]) -> list[bytes]: a run of chained unit digests"},
    {"lru_pop_many", (PyCFunction)(void (*)(void))kvr_lru_pop_many, METH_FASTCALL,
     "lru_pop_many(nxt, prv, inq, count) -> list[int]: LRUPolicy.pop_many's unlinking"},
    {"lru_link", (PyCFunction)(void (*)(void))kvr_lru_link, METH_FASTCALL,
     "lru_link(nxt, prv, inq, unkeyed, keyed): LRUPolicy.release's linking"},
    {"ref_adopt", (PyCFunction)(void (*)(void))kvr_ref_adopt, METH_FASTCALL,
     "ref_adopt(table, blocks) -> list[int]: the blocks whose count was 0"},
    {"evict_keys", (PyCFunction)(void (*)(void))kvr_evict_keys, METH_FASTCALL,
     "evict_keys(table, blocks, group_id, ref_count, ghost, rows) -> (gone, num_keys, num_blocks)"},
    {"publish_keys", (PyCFunction)(void (*)(void))kvr_publish_keys, METH_FASTCALL,
     "publish_keys(table, group_id, blocks, keys, boundaries) -> (done, fresh)"},
    {"release_refs", (PyCFunction)(void (*)(void))kvr_release_refs, METH_FASTCALL,
     "release_refs(table, ordered) -> None | (unkeyed, keyed)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvreuse.core._native", "Optional C kernels of the kvreuse core.", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    kvr_sha256_load();
    if (PyType_Ready(&kvr_GhostType) < 0 ||
        PyModule_AddObjectRef(m, "Ghost", (PyObject *)&kvr_GhostType) < 0 ||
        PyType_Ready(&kvr_TableType) < 0 ||
        PyModule_AddObjectRef(m, "BlockTable", (PyObject *)&kvr_TableType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddStringConstant(m, "SOURCE_SHA256", KVR_SOURCE_SHA256) < 0 ||
        PyModule_AddStringConstant(m, "SHA256_BACKEND",
                                   kvr_sha256_backend()) < 0 ||
        PyModule_AddStringConstant(m, "SHA256_LIBRARY", kvr_sha256_library()) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
