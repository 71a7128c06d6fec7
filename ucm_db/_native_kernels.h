/* Copy and byte-plane merge kernels shared by ucm_db._native's source files
 * (_native.c, _native_loads.c); static, so each file compiles its own. */
#ifndef UCM_DB_NATIVE_KERNELS_H
#define UCM_DB_NATIVE_KERNELS_H

#include <Python.h>

#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

static inline void merge2(uint8_t *out, size_t n, const uint8_t *p0, const uint8_t *p1)
{
#if PY_LITTLE_ENDIAN
    for (size_t i = 0; i < n; i++) {
        uint16_t w = (uint16_t)(p0[i] | (uint16_t)p1[i] << 8);
        memcpy(out + 2 * i, &w, 2);
    }
#else
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = p0[i];
        out[2 * i + 1] = p1[i];
    }
#endif
}

static inline void merge4(uint8_t *out, size_t n, const uint8_t *p0, const uint8_t *p1, const uint8_t *p2, const uint8_t *p3)
{
#if PY_LITTLE_ENDIAN
    for (size_t i = 0; i < n; i++) {
        uint32_t w = (uint32_t)p0[i] | (uint32_t)p1[i] << 8 | (uint32_t)p2[i] << 16 | (uint32_t)p3[i] << 24;
        memcpy(out + 4 * i, &w, 4);
    }
#else
    for (size_t i = 0; i < n; i++) {
        out[4 * i] = p0[i];
        out[4 * i + 1] = p1[i];
        out[4 * i + 2] = p2[i];
        out[4 * i + 3] = p3[i];
    }
#endif
}

static inline int overlaps(const Py_buffer *a, const Py_buffer *b)
{
    const char *a0 = a->buf, *b0 = b->buf;
    return a->len > 0 && b->len > 0 && a0 < b0 + b->len && b0 < a0 + a->len;
}

/* Pieces this large are written with non-temporal stores (where SSE2 has
 * them): a load fills KV cache pages that are not read again before the
 * next forward, and plain stores first read each destination line
 * (read-for-ownership), which measured about a third of a 64 KiB unit's
 * copy time. Large memcpy calls (numpy's copyto of a whole cache) do the
 * same inside glibc. */
#define STREAM_MIN_BYTES ((Py_ssize_t)4096)

static inline void copy_piece(char *dst, const char *src, Py_ssize_t n)
{
#if defined(__SSE2__)
    if (n >= STREAM_MIN_BYTES) {
        size_t head = (size_t)(-(uintptr_t)dst & 15); /* to a 16-byte boundary */
        memcpy(dst, src, head);
        dst += head;
        src += head;
        n -= (Py_ssize_t)head;
        Py_ssize_t blocks = n / 64;
        for (Py_ssize_t i = 0; i < blocks; i++) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + 0));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)(dst + 0), a);
            _mm_stream_si128((__m128i *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(dst + 48), d);
            src += 64;
            dst += 64;
        }
        memcpy(dst, src, (size_t)(n - blocks * 64));
        _mm_sfence(); /* the streamed stores are ordered before anything that follows */
        return;
    }
#endif
    memcpy(dst, src, (size_t)n);
}

/* A destination piece: where it starts and how many bytes it takes. */
typedef struct {
    char *buf;
    Py_ssize_t len;
} piece_t;

/* merge2 into memory not read again soon (a KV cache's slabs): from the
 * first 16-byte boundary on, with non-temporal stores where SSE2 has them
 * (see copy_piece: plain stores first read each destination line). */
static inline void merge2_streamed(uint8_t *out, size_t n, const uint8_t *p0, const uint8_t *p1)
{
#if defined(__SSE2__) && PY_LITTLE_ENDIAN
    size_t head = (size_t)(-(uintptr_t)out & 15);
    if (2 * n >= (size_t)STREAM_MIN_BYTES && head % 2 == 0) {
        head /= 2; /* elements before the boundary */
        merge2(out, head, p0, p1);
        size_t i = head, blocks = (n - head) / 16;
        for (size_t b = 0; b < blocks; b++, i += 16) {
            __m128i lo = _mm_loadu_si128((const __m128i *)(p0 + i));
            __m128i hi = _mm_loadu_si128((const __m128i *)(p1 + i));
            _mm_stream_si128((__m128i *)(out + 2 * i), _mm_unpacklo_epi8(lo, hi));
            _mm_stream_si128((__m128i *)(out + 2 * i + 16), _mm_unpackhi_epi8(lo, hi));
        }
        merge2(out + 2 * i, n - i, p0 + i, p1 + i);
        _mm_sfence(); /* the streamed stores are ordered before anything that follows */
        return;
    }
#endif
    merge2(out, n, p0, p1);
}

/* Merges n elements of element_bytes from planes into pieces, starting
 * skip bytes into them; every piece boundary crossed falls between two
 * elements (checked by the caller). */
static inline void merge_pieces(const piece_t *pieces, Py_ssize_t skip, size_t n, int element_bytes, const Py_buffer planes[4])
{
    Py_ssize_t i = 0;
    while (skip >= pieces[i].len) {
        skip -= pieces[i].len;
        i++;
    }
    size_t done = 0;
    while (done < n) {
        size_t room = (size_t)((pieces[i].len - skip) / element_bytes);
        size_t take = room < n - done ? room : n - done;
        uint8_t *out = (uint8_t *)pieces[i].buf + skip;
        const uint8_t *p[4] = {NULL, NULL, NULL, NULL};
        for (int j = 0; j < element_bytes; j++) {
            p[j] = (const uint8_t *)planes[j].buf + done;
        }
        if (element_bytes == 2) {
            merge2_streamed(out, take, p[0], p[1]);
        } else {
            merge4(out, take, p[0], p[1], p[2], p[3]);
        }
        done += take;
        skip = 0;
        i++;
    }
}

/* Hashes a chunk of a copy: 0, or -1 to stop it (the hasher failed). */
typedef int (*chunk_hash_t)(void *hasher, const char *at, Py_ssize_t n);

/* src[0, len) into pieces filled one after another (they hold at least len
 * bytes), each chunk of at most chunk_bytes hashed (one call, however many
 * pieces it spans: src is contiguous), then copied into the pieces it spans
 * while it is still in cache: a byte is read from memory once. 0, or -1 if
 * hash stopped it. */
static inline int hash_then_copy(const char *src, Py_ssize_t len, const piece_t *pieces, chunk_hash_t hash, void *hasher,
                                 Py_ssize_t chunk_bytes)
{
    if (chunk_bytes <= 0) {
        chunk_bytes = len > 0 ? len : 1;
    }
    Py_ssize_t at = 0, i = 0, filled = 0; /* filled: bytes of pieces[i] written */
    while (at < len) {
        Py_ssize_t stop = len - at < chunk_bytes ? len : at + chunk_bytes;
        if (hash(hasher, src + at, stop - at) < 0) {
            return -1;
        }
        while (at < stop) {
            while (filled == pieces[i].len) {
                i++;
                filled = 0;
            }
            Py_ssize_t n = pieces[i].len - filled < stop - at ? pieces[i].len - filled : stop - at;
            copy_piece(pieces[i].buf + filled, src + at, n);
            filled += n;
            at += n;
        }
    }
    return 0;
}

#endif /* UCM_DB_NATIVE_KERNELS_H */
