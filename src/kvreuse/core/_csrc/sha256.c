/*
 * SHA-256 for the chain kernel: OpenSSL's libcrypto, which Python's hashlib already loaded, found
 * at import with dlopen/dlsym (no OpenSSL headers: the three prototypes are declared here), or,
 * when it cannot be found, the portable implementation below.
 */
#include "kvr.h"

#ifndef _WIN32
#include <dlfcn.h>
#endif

/* ------------------------------------------------------------------ portable SHA-256 */

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5,
    0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3,
    0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc,
    0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13,
    0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3,
    0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5,
    0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208,
    0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static const uint32_t H256[8] = {
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
    0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
};

#define ROTR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static uint32_t
load_be32(const unsigned char *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static void
store_be32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)(v >> 24);
    p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)v;
}

static void
compress(uint32_t h[8], const unsigned char *block)
{
    uint32_t w[64], a, b, c, d, e, f, g, k, t1, t2;
    int i;
    for (i = 0; i < 16; i++)
        w[i] = load_be32(block + 4 * i);
    for (i = 16; i < 64; i++) {
        uint32_t s0 = ROTR(w[i - 15], 7) ^ ROTR(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ROTR(w[i - 2], 17) ^ ROTR(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
    for (i = 0; i < 64; i++) {
        t1 = k + (ROTR(e, 6) ^ ROTR(e, 11) ^ ROTR(e, 25)) + ((e & f) ^ (~e & g)) + K256[i] + w[i];
        t2 = (ROTR(a, 2) ^ ROTR(a, 13) ^ ROTR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        k = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
    }
    h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += k;
}

static void
portable_sha256(const unsigned char *msg, size_t len, unsigned char *out)
{
    uint32_t h[8];
    unsigned char last[128];
    size_t full = len / 64, rest = len % 64, tail_len, i;
    uint64_t bits = (uint64_t)len * 8;
    memcpy(h, H256, sizeof h);
    for (i = 0; i < full; i++)
        compress(h, msg + 64 * i);
    /* padding: 0x80, zeros, then the bit length (big-endian) in the last 8 bytes */
    tail_len = rest + 9 <= 64 ? 64 : 128;
    memset(last, 0, sizeof last);
    memcpy(last, msg + 64 * full, rest);
    last[rest] = 0x80;
    for (i = 0; i < 8; i++)
        last[tail_len - 1 - i] = (unsigned char)(bits >> (8 * i));
    compress(h, last);
    if (tail_len == 128)
        compress(h, last + 64);
    for (i = 0; i < 8; i++)
        store_be32(out + 4 * i, h[i]);
}

/* ------------------------------------------------------------------ libcrypto, found at run time */

/* OpenSSL's SHA256_CTX is 112 bytes; a larger, aligned buffer keeps us independent of it. */
typedef union {
    unsigned char bytes[512];
    uint64_t align;
} sha_ctx;
typedef int (*sha_init_fn)(void *);
typedef int (*sha_update_fn)(void *, const void *, size_t);
typedef int (*sha_final_fn)(unsigned char *, void *);

static sha_init_fn ossl_init;
static sha_update_fn ossl_update;
static sha_final_fn ossl_final;
static char backend_library[512];

void
kvr_sha256(const unsigned char *msg, size_t len, unsigned char *out, int portable)
{
    if (ossl_init != NULL && !portable) {
        sha_ctx ctx;
        ossl_init(&ctx);
        ossl_update(&ctx, msg, len);
        ossl_final(out, &ctx);
    }
    else {
        portable_sha256(msg, len, out);
    }
}

#ifndef _WIN32
static int
bind_libcrypto(void *handle)
{
    sha_init_fn init;
    sha_update_fn update;
    sha_final_fn final;
    unsigned char probe[200], ours[DIGEST_SIZE], theirs[DIGEST_SIZE];
    sha_ctx ctx;
    size_t i;
    if (handle == NULL)
        return 0;
    /* function pointers from dlsym: the cast through void* is how POSIX hands them out */
    *(void **)&init = dlsym(handle, "SHA256_Init");
    *(void **)&update = dlsym(handle, "SHA256_Update");
    *(void **)&final = dlsym(handle, "SHA256_Final");
    if (init == NULL || update == NULL || final == NULL)
        return 0;
    /* trust the library only if it agrees with the portable code on a 3-block message */
    for (i = 0; i < sizeof probe; i++)
        probe[i] = (unsigned char)(i * 7 + 3);
    if (!init(&ctx) || !update(&ctx, probe, sizeof probe) || !final(theirs, &ctx))
        return 0;
    portable_sha256(probe, sizeof probe, ours);
    if (memcmp(ours, theirs, DIGEST_SIZE) != 0)
        return 0;
    ossl_init = init, ossl_update = update, ossl_final = final;
    return 1;
}

/* The libcrypto that hashlib links to is already loaded: dlsym on _hashlib's own handle
 * searches its dependencies. Well-known sonames are the fallback. */
void
kvr_sha256_load(void)
{
    static const char *names[] = {"libcrypto.so.3", "libcrypto.so.1.1", "libcrypto.3.dylib",
                                  "libcrypto.dylib", "libcrypto.so", NULL};
    PyObject *mod = PyImport_ImportModule("_hashlib");
    int i;
    if (mod != NULL) {
        PyObject *path = PyModule_GetFilenameObject(mod);
        if (path != NULL) {
            const char *p = PyUnicode_AsUTF8(path);
            int flags = RTLD_LAZY | RTLD_LOCAL;
#ifdef RTLD_NOLOAD
            flags |= RTLD_NOLOAD;
#endif
            if (p != NULL && bind_libcrypto(dlopen(p, flags))) {
                snprintf(backend_library, sizeof backend_library, "%s", p);
                Py_DECREF(path);
                Py_DECREF(mod);
                return;
            }
            Py_DECREF(path);
        }
        Py_DECREF(mod);
    }
    PyErr_Clear();
    for (i = 0; names[i] != NULL; i++) {
        if (bind_libcrypto(dlopen(names[i], RTLD_LAZY | RTLD_LOCAL))) {
            snprintf(backend_library, sizeof backend_library, "%s", names[i]);
            return;
        }
    }
}
#else
void
kvr_sha256_load(void)
{
}
#endif

const char *
kvr_sha256_backend(void)
{
    return ossl_init != NULL ? "libcrypto" : "portable";
}

const char *
kvr_sha256_library(void)
{
    return backend_library;
}
