/* ucm_db._native, part two: a batch of stored units verified and written
 * into a KV cache's slabs by one call per thread, without the GIL.
 *
 *   bind_loads(xxh3_paths, zstd_paths) -> tuple[str | None, str | None]
 *       binds the XXH3-64 streaming functions and the zstd decompressor
 *       from the first library of each list that dlopen finds and that
 *       exports them all (a system libxxhash/libzstd, or the shared objects
 *       of the xxhash and zstandard wheels, which export their C API);
 *       returns the paths bound (None: not bound, load_units declines).
 *       The caller checks the bound functions against the Python modules
 *       before it uses them (ucm_db.codec.batch_loads).
 *       XXH3's update is the library's runtime-dispatched one where it
 *       exports it (xxh3_update_name() -> str | None says which is bound).
 *   load_units(heads, bodies, kinds, checksums, views, slab_bytes, indices,
 *              state, chunk_units, chunk_bytes) -> int
 *       unit i (head and body: views of the stored block; kinds[i] 1 for a
 *       raw block, 2 for a zstd block of shuffled frames, 0 to skip: its
 *       head and body are not read and may be None, and it is DECLINED;
 *       checksums[8i:8i+8] its stored XXH3-64, little-endian) is verified
 *       and written into slab indices[i] of each of views (as
 *       copy_into_slabs). state is a bytearray of 8 + n bytes that every
 *       thread working on the same batch shares: its first 8 bytes count the
 *       units claimed (each call claims chunk_units at a time until none is
 *       left), byte 8 + i becomes LOADED (1) once unit i is in its slabs,
 *       verified, or DECLINED (3) for anything else: a checksum mismatch, a
 *       frame that does not decode, slabs that do not fit. The caller hands
 *       a declined unit to the Python path, which decides it (and names the
 *       reason of a corrupt one). Returns the units this call claimed.
 *
 * Invariants:
 *     * LOADED means what the Python path's checks mean: the checksum is
 *       XXH3-64 over the head up to its checksum field, eight zero bytes,
 *       the frame table, then the body (codec_format.head_hasher), compared
 *       with the stored one; a raw unit is hashed chunk by chunk right
 *       before each chunk is copied (one read of each byte); a zstd unit is
 *       verified before it is decoded, each compressed plane is exactly one
 *       zstd frame (ZSTD_findFrameCompressedSize is the plane's whole
 *       length; not a skippable frame) that decompresses to exactly the size
 *       its table gives (zstd_exact: the Python path's rule, codec/decoding.py
 *       _zstd_bytes and _zstd_into), and the planes are merged as merge_planes_into_slabs does.
 *     * A DECLINED unit may have written part of its slabs (as a failed
 *       get_into block may); the Python path writes it again whole or
 *       reports it failed.
 *     * Every buffer is pinned before the GIL is released and released after
 *       it is taken back; no Python object is touched without the GIL.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_native_kernels.h"
#include "_native_loads.h"

/* The codec's layout (ucm_db/codec/header.py: HEADER_STRUCT "<4sHBBIQQ32sQ",
 * FRAME_STRUCT "<QQBBB5x"); tests/test_batch_loads.py checks them. */
#define HEADER_BYTES 68
#define CHECKSUM_AT 60
#define N_FRAMES_AT 8
#define RAW_LEN_AT 12
#define FRAME_BYTES 24
#define MODE_SHUFFLE 2
#define MAX_SLABS 1024

enum { KIND_SKIP = 0, KIND_RAW = 1, KIND_SHUFFLED = 2 };
enum { UNIT_LOADED = 1, UNIT_DECLINED = 3 };

/* The public C API of xxHash and zstd, as their headers declare it. */
typedef struct xxh3_state xxh3_state;
static struct {
    xxh3_state *(*create)(void);
    int (*free_state)(xxh3_state *);
    int (*reset)(xxh3_state *);
    int (*update)(xxh3_state *, const void *, size_t);
    uint64_t (*digest)(const xxh3_state *);
} xxh;
static struct {
    void *(*create)(void);
    size_t (*free_ctx)(void *);
    size_t (*decompress)(void *, void *, size_t, const void *, size_t);
    unsigned (*is_error)(size_t);
    unsigned long long (*content_size)(const void *, size_t);
    size_t (*frame_bytes)(const void *, size_t);
} zstd;
static int xxh_bound, zstd_bound;
/* The XXH3 update symbol bound: the library's runtime-dispatched one (AVX2
 * or AVX-512 where the CPU has it) when it exports one, else the baseline
 * (SSE2 on x86-64), which is half as fast on this project's hosts. */
static const char *xxh_update_name;
static const char XXH_UPDATE_DISPATCH[] = "XXH3_64bits_update_dispatch";
#define ZSTD_SIZE_UNKNOWN (0ULL - 1)
#define ZSTD_MAGIC 0xFD2FB528U

static int bind_symbols(void *lib, const char *const names[], void **slots, int n)
{
    for (int i = 0; i < n; i++) {
        slots[i] = dlsym(lib, names[i]);
        if (slots[i] == NULL) {
            return 0;
        }
    }
    return 1;
}

/* The first of paths (a list of str) that opens and exports names; its
 * path as a str, or None. Slots are filled only from that library. */
static PyObject *bind_first(PyObject *paths, const char *const names[], void **slots, int n, int *bound,
                            const char *preferred, int preferred_at, const char **bound_name)
{
    PyObject *seq = PySequence_Fast(paths, "paths must be a list of str");
    if (seq == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        const char *path = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(seq, i));
        if (path == NULL) {
            Py_DECREF(seq);
            return NULL;
        }
        void *lib = dlopen(path, RTLD_LAZY | RTLD_LOCAL);
        if (lib == NULL) {
            continue;
        }
        void *found[8];
        if (bind_symbols(lib, names, found, n)) {
            if (preferred != NULL) {
                /* found[preferred_at] has a variant of the same signature
                 * and result (the caller checks the digests it gives). */
                void *variant = dlsym(lib, preferred);
                *bound_name = variant != NULL ? preferred : names[preferred_at];
                if (variant != NULL) {
                    found[preferred_at] = variant;
                }
            }
            memcpy(slots, found, (size_t)n * sizeof(void *));
            *bound = 1;
            PyObject *name = PySequence_Fast_GET_ITEM(seq, i);
            Py_INCREF(name);
            Py_DECREF(seq);
            return name; /* the library stays open for the process's life */
        }
        dlclose(lib);
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

PyObject *native_bind_loads(PyObject *module, PyObject *args)
{
    static const char *const xxh_names[] = {"XXH3_createState", "XXH3_freeState", "XXH3_64bits_reset",
                                            "XXH3_64bits_update", "XXH3_64bits_digest"};
    static const char *const zstd_names[] = {"ZSTD_createDCtx", "ZSTD_freeDCtx", "ZSTD_decompressDCtx", "ZSTD_isError",
                                             "ZSTD_getFrameContentSize", "ZSTD_findFrameCompressedSize"};
    PyObject *xxh_paths, *zstd_paths;
    (void)module;
    if (!PyArg_ParseTuple(args, "OO:bind_loads", &xxh_paths, &zstd_paths)) {
        return NULL;
    }
    if (!PY_LITTLE_ENDIAN) { /* the stored format is little-endian: read_u64 below assumes the host is */
        return Py_BuildValue("(OO)", Py_None, Py_None);
    }
    PyObject *xxh_path = xxh_bound ? Py_NewRef(Py_None) : bind_first(xxh_paths, xxh_names, (void **)&xxh, 5, &xxh_bound,
                                                                           XXH_UPDATE_DISPATCH, 3, &xxh_update_name);
    if (xxh_path == NULL) {
        return NULL;
    }
    PyObject *zstd_path = zstd_bound ? Py_NewRef(Py_None) : bind_first(zstd_paths, zstd_names, (void **)&zstd, 6, &zstd_bound,
                                                                              NULL, 0, NULL);
    if (zstd_path == NULL) {
        Py_DECREF(xxh_path);
        return NULL;
    }
    return Py_BuildValue("(NN)", xxh_path, zstd_path);
}

PyObject *native_loads_bound(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return Py_BuildValue("(OO)", xxh_bound ? Py_True : Py_False, zstd_bound ? Py_True : Py_False);
}

PyObject *native_xxh3_update_name(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    if (!xxh_bound || xxh_update_name == NULL) {
        Py_RETURN_NONE;
    }
    return PyUnicode_FromString(xxh_update_name);
}

PyObject *native_xxh3_parts(PyObject *module, PyObject *args)
{
    /* xxh3_parts(parts: tuple of buffers) -> int: the bound XXH3-64 over the
     * parts one after another (the caller's check of the binding). */
    PyObject *parts;
    (void)module;
    if (!PyArg_ParseTuple(args, "O!:xxh3_parts", &PyTuple_Type, &parts)) {
        return NULL;
    }
    if (!xxh_bound) {
        PyErr_SetString(PyExc_RuntimeError, "XXH3 is not bound: call bind_loads first");
        return NULL;
    }
    xxh3_state *state = xxh.create();
    if (state == NULL) {
        return PyErr_NoMemory();
    }
    xxh.reset(state);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(parts); i++) {
        Py_buffer view;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(parts, i), &view, PyBUF_SIMPLE) < 0) {
            xxh.free_state(state);
            return NULL;
        }
        xxh.update(state, view.buf, (size_t)view.len);
        PyBuffer_Release(&view);
    }
    uint64_t digest = xxh.digest(state);
    xxh.free_state(state);
    return PyLong_FromUnsignedLongLong(digest);
}

static uint32_t read_u32(const uint8_t *p);

/* Decompresses src into out, src being exactly one zstd frame (its
 * compressed size all of src, not a skippable frame) whose content size,
 * where it states one, and output are exactly n_out bytes; whether it was.
 * ZSTD_decompressDCtx alone decodes every frame concatenated in src (and
 * skips skippable ones), so a plane of two frames would load here and be
 * corrupt on the Python path. */
static int zstd_exact(void *dctx, uint8_t *out, size_t n_out, const uint8_t *src, size_t n_src)
{
    if (n_src < 4 || read_u32(src) != ZSTD_MAGIC) {
        return 0;
    }
    size_t whole = zstd.frame_bytes(src, n_src);
    if (zstd.is_error(whole) || whole != n_src) {
        return 0;
    }
    unsigned long long claimed = zstd.content_size(src, n_src);
    if (claimed != ZSTD_SIZE_UNKNOWN && claimed != (unsigned long long)n_out) {
        return 0; /* also ZSTD_CONTENTSIZE_ERROR */
    }
    size_t got = zstd.decompress(dctx, out, n_out, src, n_src);
    return !zstd.is_error(got) && got == n_out;
}

PyObject *native_zstd_decompress(PyObject *module, PyObject *args)
{
    /* zstd_decompress(frame, size) -> bytes | None: the bound decompressor's
     * output of exactly size bytes from exactly one frame (zstd_exact; None
     * if it fails or differs). */
    Py_buffer src;
    Py_ssize_t size;
    (void)module;
    if (!PyArg_ParseTuple(args, "y*n:zstd_decompress", &src, &size)) {
        return NULL;
    }
    if (!zstd_bound || size < 0) {
        PyBuffer_Release(&src);
        PyErr_SetString(PyExc_RuntimeError, "zstd is not bound (call bind_loads first) or size is negative");
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, size);
    void *dctx = zstd.create();
    int ok = out != NULL && dctx != NULL &&
             zstd_exact(dctx, (uint8_t *)PyBytes_AS_STRING(out), (size_t)size, src.buf, (size_t)src.len);
    if (dctx != NULL) {
        zstd.free_ctx(dctx);
    }
    PyBuffer_Release(&src);
    if (out == NULL) {
        return NULL;
    }
    if (!ok) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    return out;
}

/* One thread's tools: a hash state, a decompression context and a scratch
 * buffer for decompressed planes, made on first use and freed at the end. */
typedef struct {
    xxh3_state *hash;
    void *dctx;
    uint8_t *scratch;
    size_t scratch_bytes;
} tools_t;

static void tools_free(tools_t *t)
{
    if (t->hash != NULL) {
        xxh.free_state(t->hash);
    }
    if (t->dctx != NULL) {
        zstd.free_ctx(t->dctx);
    }
    free(t->scratch);
}

static uint64_t read_u64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v; /* little-endian: bind_loads binds nothing on other hosts */
}

static uint32_t read_u32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The checksum's state after the head (see the invariants). */
static void hash_head(xxh3_state *state, const uint8_t *head, size_t head_bytes)
{
    static const uint8_t zero[8] = {0};
    xxh.reset(state);
    xxh.update(state, head, CHECKSUM_AT);
    xxh.update(state, zero, 8);
    xxh.update(state, head + HEADER_BYTES, head_bytes - HEADER_BYTES);
}

static int xxh3_chunk(void *state, const char *at, Py_ssize_t n)
{
    xxh.update((xxh3_state *)state, at, (size_t)n);
    return 0;
}

/* A raw unit: hashed chunk by chunk, each chunk copied into the pieces right
 * after it is hashed (hash_then_copy); whether the digest matches. */
static int load_raw(tools_t *t, const uint8_t *head, size_t head_bytes, const uint8_t *body, size_t body_bytes,
                    uint64_t checksum, const piece_t *pieces, size_t chunk_bytes)
{
    hash_head(t->hash, head, head_bytes);
    hash_then_copy((const char *)body, (Py_ssize_t)body_bytes, pieces, xxh3_chunk, t->hash, (Py_ssize_t)chunk_bytes);
    return xxh.digest(t->hash) == checksum;
}

/* Whether n_bytes merged skip bytes into the pieces fit, every piece boundary
 * they cross falling between two elements (as check_merge_room). */
static int merge_fits(const piece_t *pieces, Py_ssize_t n_pieces, size_t skip, size_t n_bytes, size_t element_bytes)
{
    if (skip % element_bytes) {
        return 0;
    }
    size_t at = 0, end = skip + n_bytes;
    for (Py_ssize_t i = 0; i < n_pieces && at < end; i++) {
        size_t stop = at + (size_t)pieces[i].len;
        if (stop > skip && stop < end && stop % element_bytes) {
            return 0;
        }
        at = stop;
    }
    return at >= end;
}

/* A zstd unit of shuffled frames: verified, then each frame's planes
 * decompressed (or taken as stored) and merged into the pieces; whether it
 * loaded. */
static int load_shuffled(tools_t *t, const uint8_t *head, size_t head_bytes, const uint8_t *body, size_t body_bytes,
                         uint64_t checksum, const piece_t *pieces, Py_ssize_t n_pieces)
{
    hash_head(t->hash, head, head_bytes);
    xxh.update(t->hash, body, body_bytes);
    if (xxh.digest(t->hash) != checksum) {
        return 0;
    }
    uint32_t n_frames = read_u32(head + N_FRAMES_AT);
    uint64_t raw_total = read_u64(head + RAW_LEN_AT);
    if (head_bytes != HEADER_BYTES + (size_t)n_frames * FRAME_BYTES || n_frames == 0) {
        return 0;
    }
    if (t->dctx == NULL && (t->dctx = zstd.create()) == NULL) {
        return 0;
    }
    uint64_t raw_at = 0, body_at = 0;
    for (uint32_t f = 0; f < n_frames; f++) {
        const uint8_t *entry = head + HEADER_BYTES + (size_t)f * FRAME_BYTES;
        uint64_t raw_len = read_u64(entry), stored_len = read_u64(entry + 8);
        unsigned mode = entry[16], elem = entry[17], mask = entry[18];
        if (mode != MODE_SHUFFLE || (elem != 2 && elem != 4) || raw_len > raw_total - raw_at ||
            stored_len > body_bytes - body_at || raw_len % elem || stored_len < 4 * (uint64_t)elem) {
            return 0;
        }
        const uint8_t *frame = body + body_at;
        size_t plane_bytes = (size_t)(raw_len / elem), at = 4 * (size_t)elem;
        if (t->scratch_bytes < raw_len) {
            uint8_t *grown = realloc(t->scratch, (size_t)raw_len);
            if (grown == NULL) {
                return 0;
            }
            t->scratch = grown;
            t->scratch_bytes = (size_t)raw_len;
        }
        Py_buffer planes[4];
        memset(planes, 0, sizeof(planes));
        for (unsigned j = 0; j < elem; j++) {
            size_t length = read_u32(frame + 4 * j);
            if (length > stored_len - at) {
                return 0;
            }
            if (mask >> j & 1) {
                uint8_t *out = t->scratch + j * plane_bytes;
                if (!zstd_exact(t->dctx, out, plane_bytes, frame + at, length)) {
                    return 0;
                }
                planes[j].buf = out;
            } else {
                if (length != plane_bytes) {
                    return 0;
                }
                planes[j].buf = (void *)(frame + at);
            }
            planes[j].len = (Py_ssize_t)plane_bytes;
            at += length;
        }
        if (at != stored_len || !merge_fits(pieces, n_pieces, (size_t)raw_at, (size_t)raw_len, elem)) {
            return 0;
        }
        if (plane_bytes > 0) {
            merge_pieces(pieces, (Py_ssize_t)raw_at, plane_bytes, (int)elem, planes);
        }
        raw_at += raw_len;
        body_at += stored_len;
    }
    return raw_at == raw_total;
}

/* A batch's pinned inputs. */
typedef struct {
    Py_ssize_t n, n_views, slabs;
    Py_buffer *heads, *bodies, *views;
    Py_ssize_t pinned_units, pinned_views;
    Py_ssize_t *sizes, *index;
    Py_buffer kinds, checksums, state;
} batch_t;

static void batch_release(batch_t *b)
{
    for (Py_ssize_t i = 0; i < b->pinned_units; i++) {
        PyBuffer_Release(&b->heads[i]);
        PyBuffer_Release(&b->bodies[i]);
    }
    for (Py_ssize_t i = 0; i < b->pinned_views; i++) {
        PyBuffer_Release(&b->views[i]);
    }
    PyMem_Free(b->heads);
    PyMem_Free(b->bodies);
    PyMem_Free(b->views);
    PyMem_Free(b->sizes);
    PyMem_Free(b->index);
    if (b->kinds.obj != NULL) {
        PyBuffer_Release(&b->kinds);
    }
    if (b->checksums.obj != NULL) {
        PyBuffer_Release(&b->checksums);
    }
    if (b->state.obj != NULL) {
        PyBuffer_Release(&b->state);
    }
}

/* Pins every input of a batch, checking their shapes; 0, or -1 with a
 * ValueError or TypeError set (b released by the caller either way). */
static int batch_pin(batch_t *b, PyObject *heads, PyObject *bodies, PyObject *kinds, PyObject *checksums, PyObject *views,
                     PyObject *sizes, PyObject *indices, PyObject *state)
{
    memset(b, 0, sizeof(*b));
    if (!PyList_Check(heads) || !PyList_Check(bodies) || !PyList_Check(indices) || !PyTuple_Check(views) ||
        !PyTuple_Check(sizes)) {
        PyErr_SetString(PyExc_TypeError, "heads, bodies and indices must be lists, views and slab_bytes tuples");
        return -1;
    }
    b->n = PyList_GET_SIZE(heads);
    b->n_views = PyTuple_GET_SIZE(views);
    if (PyList_GET_SIZE(bodies) != b->n || PyList_GET_SIZE(indices) != b->n || b->n_views == 0 ||
        b->n_views > MAX_SLABS || PyTuple_GET_SIZE(sizes) != b->n_views) {
        PyErr_SetString(PyExc_ValueError, "heads, bodies and indices need one entry per unit; views and slab_bytes 1 to 1024 each, as many of each");
        return -1;
    }
    if (PyObject_GetBuffer(kinds, &b->kinds, PyBUF_SIMPLE) < 0 || PyObject_GetBuffer(checksums, &b->checksums, PyBUF_SIMPLE) < 0 ||
        PyObject_GetBuffer(state, &b->state, PyBUF_SIMPLE | PyBUF_WRITABLE) < 0) {
        return -1;
    }
    if (b->kinds.len != b->n || b->checksums.len != 8 * b->n || b->state.len != 8 + b->n || ((uintptr_t)b->state.buf & 7)) {
        PyErr_SetString(PyExc_ValueError, "kinds need n bytes, checksums 8n, state 8 + n (8-byte aligned)");
        return -1;
    }
    Py_ssize_t n_alloc = b->n > 0 ? b->n : 1;
    b->heads = PyMem_Calloc((size_t)n_alloc, sizeof(Py_buffer));
    b->bodies = PyMem_Calloc((size_t)n_alloc, sizeof(Py_buffer));
    b->index = PyMem_Calloc((size_t)n_alloc, sizeof(Py_ssize_t));
    b->views = PyMem_Calloc((size_t)b->n_views, sizeof(Py_buffer));
    b->sizes = PyMem_Calloc((size_t)b->n_views, sizeof(Py_ssize_t));
    if (b->heads == NULL || b->bodies == NULL || b->index == NULL || b->views == NULL || b->sizes == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->slabs = PY_SSIZE_T_MAX;
    for (; b->pinned_views < b->n_views; b->pinned_views++) {
        Py_ssize_t j = b->pinned_views;
        b->sizes[j] = PyLong_AsSsize_t(PyTuple_GET_ITEM(sizes, j));
        if (b->sizes[j] == -1 && PyErr_Occurred()) {
            return -1;
        }
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(views, j), &b->views[j], PyBUF_SIMPLE | PyBUF_WRITABLE) < 0) {
            return -1;
        }
        if (b->sizes[j] <= 0) {
            PyErr_Format(PyExc_ValueError, "slab size %zd of view %zd is not positive", b->sizes[j], j);
            b->pinned_views++;
            return -1;
        }
        Py_ssize_t count = b->views[j].len / b->sizes[j];
        b->slabs = count < b->slabs ? count : b->slabs;
    }
    for (; b->pinned_units < b->n; b->pinned_units++) {
        Py_ssize_t i = b->pinned_units;
        b->index[i] = PyLong_AsSsize_t(PyList_GET_ITEM(indices, i));
        if (b->index[i] == -1 && PyErr_Occurred()) {
            return -1;
        }
        if (((const uint8_t *)b->kinds.buf)[i] == KIND_SKIP) {
            continue;  /* never read: its head and body may be None (plan_units) */
        }
        if (PyObject_GetBuffer(PyList_GET_ITEM(heads, i), &b->heads[i], PyBUF_SIMPLE) < 0) {
            return -1;
        }
        if (PyObject_GetBuffer(PyList_GET_ITEM(bodies, i), &b->bodies[i], PyBUF_SIMPLE) < 0) {
            PyBuffer_Release(&b->heads[i]);
            return -1;
        }
    }
    return 0;
}

/* Unit i of a pinned batch: its result code. */
static uint8_t load_one(const batch_t *b, tools_t *t, Py_ssize_t i, size_t chunk_bytes)
{
    uint8_t kind = ((const uint8_t *)b->kinds.buf)[i];
    Py_ssize_t at = b->index[i];
    const Py_buffer *head = &b->heads[i], *body = &b->bodies[i];
    if ((kind != KIND_RAW && kind != KIND_SHUFFLED) || at < 0 || at >= b->slabs || head->len < HEADER_BYTES) {
        return UNIT_DECLINED;
    }
    piece_t pieces[MAX_SLABS];
    Py_ssize_t room = 0;
    for (Py_ssize_t j = 0; j < b->n_views; j++) {
        Py_buffer slab = {.buf = (char *)b->views[j].buf + at * b->sizes[j], .len = b->sizes[j]};
        if (overlaps(&slab, body) || overlaps(&slab, head)) {
            return UNIT_DECLINED;
        }
        pieces[j].buf = slab.buf;
        pieces[j].len = slab.len;
        room += slab.len;
    }
    if (read_u64((const uint8_t *)head->buf + RAW_LEN_AT) != (uint64_t)room) {
        return UNIT_DECLINED; /* not exactly its slabs' size: Python's path makes it a miss */
    }
    uint64_t checksum = read_u64((const uint8_t *)b->checksums.buf + 8 * i);
    int ok;
    if (kind == KIND_RAW) {
        ok = room == body->len && load_raw(t, head->buf, (size_t)head->len, body->buf, (size_t)body->len, checksum, pieces, chunk_bytes);
    } else {
        ok = zstd_bound && load_shuffled(t, head->buf, (size_t)head->len, body->buf, (size_t)body->len, checksum, pieces, b->n_views);
    }
    return ok ? UNIT_LOADED : UNIT_DECLINED;
}

PyObject *native_load_units(PyObject *module, PyObject *args)
{
    PyObject *heads, *bodies, *kinds, *checksums, *views, *sizes, *indices, *state;
    Py_ssize_t chunk_units, chunk_bytes;
    (void)module;
    if (!PyArg_ParseTuple(args, "OOOOOOOOnn:load_units", &heads, &bodies, &kinds, &checksums, &views, &sizes, &indices,
                          &state, &chunk_units, &chunk_bytes)) {
        return NULL;
    }
    if (!xxh_bound) {
        PyErr_SetString(PyExc_RuntimeError, "XXH3 is not bound: call bind_loads first");
        return NULL;
    }
    if (chunk_units <= 0 || chunk_bytes <= 0) {
        PyErr_SetString(PyExc_ValueError, "chunk_units and chunk_bytes must be positive");
        return NULL;
    }
    batch_t b;
    if (batch_pin(&b, heads, bodies, kinds, checksums, views, sizes, indices, state) < 0) {
        batch_release(&b);
        return NULL;
    }
    Py_ssize_t claimed = 0;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    tools_t tools = {0};
    tools.hash = xxh.create();
    if (tools.hash == NULL) {
        failed = 1;
    }
    int64_t *next = (int64_t *)b.state.buf;
    uint8_t *results = (uint8_t *)b.state.buf + 8;
    while (!failed) {
        int64_t start = __atomic_fetch_add(next, (int64_t)chunk_units, __ATOMIC_RELAXED);
        if (start >= b.n) {
            break;
        }
        Py_ssize_t stop = start + chunk_units < b.n ? (Py_ssize_t)start + chunk_units : b.n;
        for (Py_ssize_t i = (Py_ssize_t)start; i < stop; i++) {
            __atomic_store_n(&results[i], load_one(&b, &tools, i, (size_t)chunk_bytes), __ATOMIC_RELEASE);
        }
        claimed += stop - (Py_ssize_t)start;
    }
    tools_free(&tools);
    Py_END_ALLOW_THREADS
    batch_release(&b);
    if (failed) {
        return PyErr_NoMemory();
    }
    return PyLong_FromSsize_t(claimed);
}
