// deps:
/* netdelay: a learning Ethernet switch in user space that holds every frame for a fixed time,
 * for test/support/netcluster.py on kernels without sch_netem (the qdisc that normally adds delay).
 *
 *   netdelay DELAY_US PORT...
 *
 * Runs in the cluster's switch namespace with the ports (the switch ends of the hosts' veth links)
 * taken off the kernel bridge, so this is the only path between hosts. One AF_PACKET socket per
 * port with PACKET_VNET_HDR: a frame is read with its offload header (GSO size, checksum to fill
 * in) and written out the same way, so 64 KiB TCP segments cross whole and checksums stay the
 * kernel's business. Frames wait in one FIFO (every frame gets the same delay, so arrival order is
 * departure order) until DELAY_US after they were read, then go out the port that learned their
 * destination MAC, or every other port for broadcast and unknown addresses. Writing a port goes
 * through its qdisc, so netcluster's tbf rate still applies after the delay.
 *
 * Prints "ready" on stdout once every port is bound, then runs until killed. A queue over 1<<16
 * frames or 64 MiB drops the new frame, as a switch's full buffer would; drops and counts go to
 * stderr when it is killed with SIGTERM. Wake-up is ppoll's with a 1 ns timer slack (some
 * microseconds late on an idle machine, more on a busy one), so delays well below 100 us are not
 * meaningful. */
#include <arpa/inet.h>
#include <errno.h>
#include <linux/if_packet.h>
#include <linux/virtio_net.h>
#include <net/ethernet.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_PORTS 64
#define FRAME_MAX (256 * 1024) /* a GSO frame with its vnet header; larger ones are dropped */
#define QUEUE_MAX (1 << 16)
#define QUEUE_BYTES ((size_t)64 << 20)
#define MAC_SLOTS 256
#define VNET_LEN sizeof(struct virtio_net_hdr)

typedef struct {
  int64_t due_ns;
  int in;
  uint32_t len;
  unsigned char *data; /* vnet header, then the Ethernet frame */
} frame_t;

static frame_t queue[QUEUE_MAX];
static size_t q_head, q_len, q_bytes;
static struct { unsigned char mac[6]; int port; } macs[MAC_SLOTS];
static int nmacs;
static int fds[MAX_PORTS], nports;
static const char *names[MAX_PORTS];
static unsigned long long n_in, n_out, n_drop;
static int64_t delay_ns;
static volatile sig_atomic_t stop;

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void on_term(int sig) {
  (void)sig;
  stop = 1;
}

static int open_port(const char *name) {
  unsigned idx = if_nametoindex(name);
  if (!idx) {
    fprintf(stderr, "netdelay: no interface %s in this namespace\n", name);
    return -1;
  }
  int fd = socket(AF_PACKET, SOCK_RAW | SOCK_NONBLOCK | SOCK_CLOEXEC, htons(ETH_P_ALL));
  if (fd < 0) {
    fprintf(stderr, "netdelay: packet socket: %s (needs CAP_NET_RAW)\n", strerror(errno));
    return -1;
  }
  int one = 1;
  struct packet_mreq mr = {.mr_ifindex = (int)idx, .mr_type = PACKET_MR_PROMISC};
  struct sockaddr_ll sa = {.sll_family = AF_PACKET, .sll_protocol = htons(ETH_P_ALL),
                           .sll_ifindex = (int)idx};
  if (setsockopt(fd, SOL_PACKET, PACKET_VNET_HDR, &one, sizeof one) ||
      setsockopt(fd, SOL_PACKET, PACKET_IGNORE_OUTGOING, &one, sizeof one) ||
      setsockopt(fd, SOL_PACKET, PACKET_ADD_MEMBERSHIP, &mr, sizeof mr) ||
      bind(fd, (struct sockaddr *)&sa, sizeof sa)) {
    fprintf(stderr, "netdelay: port %s: %s\n", name, strerror(errno));
    close(fd);
    return -1;
  }
  return fd;
}

static int port_of(const unsigned char *mac) {
  for (int i = 0; i < nmacs; i++)
    if (!memcmp(macs[i].mac, mac, 6)) return macs[i].port;
  return -1;
}

static void learn(const unsigned char *mac, int port) {
  if (mac[0] & 1) return; /* a group address is never a source */
  for (int i = 0; i < nmacs; i++)
    if (!memcmp(macs[i].mac, mac, 6)) {
      macs[i].port = port;
      return;
    }
  int slot = nmacs < MAC_SLOTS ? nmacs++ : (int)(n_in % MAC_SLOTS);
  memcpy(macs[slot].mac, mac, 6);
  macs[slot].port = port;
}

static void send_to(int port, const frame_t *f) {
  if (send(fds[port], f->data, f->len, MSG_DONTWAIT) == (ssize_t)f->len)
    n_out++;
  else
    n_drop++; /* a full qdisc (tbf's queue) drops, as the bridge path would */
}

static void forward(const frame_t *f) {
  const unsigned char *dst = f->data + VNET_LEN;
  int out = (dst[0] & 1) ? -1 : port_of(dst);
  if (out >= 0) {
    if (out != f->in) send_to(out, f);
    return;
  }
  for (int p = 0; p < nports; p++)
    if (p != f->in) send_to(p, f);
}

/* Reads what port p has (a bounded batch, so one busy port cannot starve the others). */
static int drain_port(int p, unsigned char *buf) {
  for (int k = 0; k < 64; k++) {
    ssize_t n = recv(fds[p], buf, FRAME_MAX, MSG_DONTWAIT | MSG_TRUNC);
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
      if (errno == ENETDOWN) return 0; /* the link is going away with the cluster */
      fprintf(stderr, "netdelay: port %s: recv: %s\n", names[p], strerror(errno));
      return -1;
    }
    n_in++;
    if ((size_t)n > FRAME_MAX || (size_t)n < VNET_LEN + 14 || q_len == QUEUE_MAX ||
        q_bytes + (size_t)n > QUEUE_BYTES) {
      n_drop++;
      continue;
    }
    unsigned char *copy = malloc((size_t)n);
    if (!copy) {
      n_drop++;
      continue;
    }
    memcpy(copy, buf, (size_t)n);
    learn(buf + VNET_LEN + 6, p);
    queue[(q_head + q_len) % QUEUE_MAX] = (frame_t){.due_ns = now_ns() + delay_ns, .in = p,
                                                     .len = (uint32_t)n, .data = copy};
    q_len++;
    q_bytes += (size_t)n;
  }
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: netdelay DELAY_US PORT...\n");
    return 2;
  }
  char *end;
  double delay_us = strtod(argv[1], &end);
  if (*end || !(delay_us >= 0) || delay_us > 10e6) {
    fprintf(stderr, "netdelay: delay %s: expected microseconds from 0 to 10000000\n", argv[1]);
    return 2;
  }
  delay_ns = (int64_t)(delay_us * 1000.0);
  if (argc - 2 > MAX_PORTS) {
    fprintf(stderr, "netdelay: %d ports: at most %d\n", argc - 2, MAX_PORTS);
    return 2;
  }
  for (int i = 2; i < argc; i++) {
    names[nports] = argv[i];
    if ((fds[nports] = open_port(argv[i])) < 0) return 1;
    nports++;
  }
  prctl(PR_SET_TIMERSLACK, 1UL); /* ppoll wakes at the due time, not up to 50 us later */
  /* A real-time thread runs the moment a frame is due, also while the emulated hosts' compute
   * keeps every core busy; as an ordinary thread it would wait for the scheduler to preempt
   * one (milliseconds), and the delay would grow with the hosts' load. */
  struct sched_param sp = {.sched_priority = 10};
  if (sched_setscheduler(0, SCHED_FIFO, &sp))
    fprintf(stderr, "netdelay: warning: no real-time priority (%s): delays grow when the cores are busy\n",
            strerror(errno));
  struct sigaction sa = {.sa_handler = on_term};
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGINT, &sa, NULL);
  unsigned char *buf = malloc(FRAME_MAX);
  if (!buf) return 1;
  printf("ready\n");
  fflush(stdout);

  struct pollfd pf[MAX_PORTS];
  for (int p = 0; p < nports; p++) pf[p] = (struct pollfd){.fd = fds[p], .events = POLLIN};
  while (!stop) {
    int64_t now = now_ns();
    while (q_len && queue[q_head].due_ns <= now) {
      frame_t *f = &queue[q_head];
      forward(f);
      q_bytes -= f->len;
      free(f->data);
      q_head = (q_head + 1) % QUEUE_MAX;
      q_len--;
    }
    struct timespec ts, *tp = NULL;
    if (q_len) {
      int64_t wait = queue[q_head].due_ns - now;
      if (wait < 0) wait = 0;
      ts = (struct timespec){.tv_sec = wait / 1000000000, .tv_nsec = wait % 1000000000};
      tp = &ts;
    }
    int n = ppoll(pf, (nfds_t)nports, tp, NULL);
    if (n < 0) {
      if (errno == EINTR) continue;
      fprintf(stderr, "netdelay: ppoll: %s\n", strerror(errno));
      return 1;
    }
    for (int p = 0; p < nports && n > 0; p++) {
      if (!pf[p].revents) continue;
      if (pf[p].revents & (POLLERR | POLLNVAL)) {
        fprintf(stderr, "netdelay: port %s failed (the link was deleted?)\n", names[p]);
        return 1;
      }
      if (drain_port(p, buf)) return 1;
    }
  }
  fprintf(stderr, "netdelay: %llu frames in, %llu out, %llu dropped\n", n_in, n_out, n_drop);
  return 0;
}
