/*
 * BlockTable: the pool's per-block state (pool.py's BlockPool), bound once by name, so that
 * the kernels of pool.c and publish.c read the pool's own objects from one place instead of
 * receiving them by position on every call:
 *
 *     ref    array('i')  reference counts        b1     array('i')  highest boundary
 *     group  array('b')  group of each block     key1   list        highest key, or None
 *     more   dict        block -> lower keys     index  list        per group: key -> block
 *
 * The objects are the pool's (never copied); a deep copy or a pickle of the pool copies them
 * once and rebinds a table to the copies (__reduce__).
 */
#include "kvr.h"

static int
check(PyObject *o, Py_ssize_t itemsize, const char *name)
{
    flat f;
    if (flat_open(o, itemsize, name, &f) < 0)
        return -1;
    PyBuffer_Release(&f.view);
    return 0;
}

static int
Table_init(kvr_table *t, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"ref", "group", "b1", "key1", "more", "index", NULL};
    PyObject *ref, *group, *b1, *key1, *more, *index;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO!O!O!", names, &ref, &group, &b1,
                                     &PyList_Type, &key1, &PyDict_Type, &more, &PyList_Type,
                                     &index))
        return -1;
    if (check(ref, 4, "BlockTable ref") < 0 || check(group, 1, "BlockTable group") < 0 ||
        check(b1, 4, "BlockTable b1") < 0)
        return -1;
    Py_XSETREF(t->ref, Py_NewRef(ref));
    Py_XSETREF(t->group, Py_NewRef(group));
    Py_XSETREF(t->b1, Py_NewRef(b1));
    Py_XSETREF(t->key1, Py_NewRef(key1));
    Py_XSETREF(t->more, Py_NewRef(more));
    Py_XSETREF(t->index, Py_NewRef(index));
    return 0;
}

static void
Table_dealloc(kvr_table *t)
{
    Py_XDECREF(t->ref);
    Py_XDECREF(t->group);
    Py_XDECREF(t->b1);
    Py_XDECREF(t->key1);
    Py_XDECREF(t->more);
    Py_XDECREF(t->index);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyObject *
Table_reduce(kvr_table *t, PyObject *unused)
{
    return Py_BuildValue("(O(OOOOOO))", Py_TYPE(t), t->ref, t->group, t->b1, t->key1, t->more,
                         t->index);
}

static PyMethodDef Table_methods[] = {
    {"__reduce__", (PyCFunction)Table_reduce, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

PyTypeObject kvr_TableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvreuse.core._native.BlockTable",
    .tp_basicsize = sizeof(kvr_table),
    .tp_dealloc = (destructor)Table_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "BlockTable(ref, group, b1, key1, more, index): the pool's state for the kernels",
    .tp_methods = Table_methods,
    .tp_init = (initproc)Table_init,
    .tp_new = PyType_GenericNew,
};

/* The table argument of a kernel, checked. */
kvr_table *
kvr_table_arg(PyObject *o, const char *name)
{
    if (!PyObject_TypeCheck(o, &kvr_TableType) || ((kvr_table *)o)->ref == NULL) {
        PyErr_Format(PyExc_TypeError, "%s: the first argument must be a bound BlockTable", name);
        return NULL;
    }
    return (kvr_table *)o;
}
