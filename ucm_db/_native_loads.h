/* The functions of _native_loads.c and _native_plan.c that ucm_db._native's method table lists. */
#ifndef UCM_DB_NATIVE_LOADS_H
#define UCM_DB_NATIVE_LOADS_H

#include <Python.h>

PyObject *native_bind_loads(PyObject *module, PyObject *args);
PyObject *native_loads_bound(PyObject *module, PyObject *unused);
PyObject *native_xxh3_update_name(PyObject *module, PyObject *unused);
PyObject *native_xxh3_parts(PyObject *module, PyObject *args);
PyObject *native_zstd_decompress(PyObject *module, PyObject *args);
PyObject *native_load_units(PyObject *module, PyObject *args);
PyObject *native_plan_units(PyObject *module, PyObject *args);  /* _native_plan.c */

#endif /* UCM_DB_NATIVE_LOADS_H */
