/* The transport's floor, compiled: a ZeroMQ SUB that receives every message and drops it,
 * drained once per tick like pagekv ingest-vllm. bench/vllm_ingest.py builds it with gcc
 * against the libzmq that pyzmq bundles (no header ships with it, so the few calls used are
 * declared here from libzmq's documented C API) and runs it beside the ingester: what any
 * subscriber, in any language, pays here to receive the stream.
 *
 *     zmq_floor ENDPOINT TOPIC TICK_MS
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define ZMQ_SUB 2
#define ZMQ_SUBSCRIBE 6
#define ZMQ_RCVMORE 13
#define ZMQ_RCVHWM 24
#define ZMQ_DONTWAIT 1
#define ZMQ_POLLIN 1

typedef struct {
    void *socket;
    int fd;
    short events;
    short revents;
} zmq_pollitem_t;

void *zmq_ctx_new(void);
void *zmq_socket(void *ctx, int type);
int zmq_setsockopt(void *s, int option, const void *value, size_t len);
int zmq_getsockopt(void *s, int option, void *value, size_t *len);
int zmq_connect(void *s, const char *endpoint);
int zmq_recv(void *s, void *buf, size_t len, int flags);
int zmq_poll(zmq_pollitem_t *items, int n, long timeout_ms);

static char buf[1 << 20];

/* Receive every part of one message without waiting; 0 when none was there. */
static int recv_message(void *sub) {
    int more = 1;
    size_t len = sizeof more;
    if (zmq_recv(sub, buf, sizeof buf, ZMQ_DONTWAIT) < 0)
        return 0;
    for (;;) {
        if (zmq_getsockopt(sub, ZMQ_RCVMORE, &more, &len) != 0 || !more)
            return 1;
        zmq_recv(sub, buf, sizeof buf, 0);
    }
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s ENDPOINT TOPIC TICK_MS\n", argv[0]);
        return 2;
    }
    long tick_ms = atol(argv[3]);
    struct timespec tick = {tick_ms / 1000, (tick_ms % 1000) * 1000000L};
    int hwm = 100000;
    void *sub = zmq_socket(zmq_ctx_new(), ZMQ_SUB);
    zmq_setsockopt(sub, ZMQ_RCVHWM, &hwm, sizeof hwm);
    zmq_setsockopt(sub, ZMQ_SUBSCRIBE, argv[2], strlen(argv[2]));
    if (zmq_connect(sub, argv[1]) != 0) {
        fprintf(stderr, "cannot connect to %s\n", argv[1]);
        return 1;
    }
    zmq_pollitem_t item = {sub, 0, ZMQ_POLLIN, 0};
    for (;;) {
        if (zmq_poll(&item, 1, 250) <= 0)
            continue;
        nanosleep(&tick, NULL);
        while (recv_message(sub))
            ;
    }
}
