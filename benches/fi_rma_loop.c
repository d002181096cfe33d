// Minimal fi_write/fi_read loop on an FI_EP_RDM endpoint (reference for kvxfer's libfabric transport).
// server: fi_rma_loop -s PORT [-p PROV] [-b BLOCKS]
// client: fi_rma_loop -c HOST PORT [-p PROV] [-z SIZE] [-n ITERS] [-r] [-d DEPTH] [-b BLOCKS] [-D]
// ping-pong: fi_rma_loop -L -n ITERS [-D] with -s or -c as above, on both sides.
// Operation i moves block i % BLOCKS of SIZE bytes (same offset on both sides;
// the buffer is BLOCKS * SIZE bytes, so the memory touched is that of a
// workload rather than one cache-resident block). -D: writes complete on
// delivery (FI_DELIVERY_COMPLETE, as kvxfer's do: a completed WRITE has
// landed in the target's memory), else on transmit (the provider's default).
// -L: 8-byte WRITEs bounced between the two sides, as `kvxfer-bench
// --pingpong` bounces them: each side writes the next value into the other's
// buffer, waits for its WRITE's completion, then polls its queue (its
// provider's progress) until the other's value lands in its own buffer. One
// thread a side, as fi_pingpong. Prints half the median round trip.
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <time.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <fcntl.h>
#include <errno.h>

#define CK(x) do { int _r = (x); if (_r) { fprintf(stderr, "%s: %d %s\n", #x, _r, fi_strerror(-_r)); exit(1);} } while (0)
struct xchg { char name[64]; size_t namelen; uint64_t addr, key; };
static double now(void){ struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9; }
static int by_value(const void *a, const void *b){ double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }
static void full(int fd, void *b, size_t n, int wr){ char *p=b; while(n){ ssize_t k = wr? write(fd,p,n):read(fd,p,n); if(k<=0){perror("oob");exit(1);} p+=k; n-=k; } }

int main(int argc, char **argv){
  int server = 0; const char *host = NULL; int port = 0; const char *prov = "tcp;ofi_rxm";
  size_t size = 1<<20; long iters = 1000; int rd = 0; int depth = 16; size_t blocks = 1; int dc = 0; int lat = 0;
  for (int i=1;i<argc;i++){
    if(!strcmp(argv[i],"-s")){server=1; port=atoi(argv[++i]);}
    else if(!strcmp(argv[i],"-c")){host=argv[++i]; port=atoi(argv[++i]);}
    else if(!strcmp(argv[i],"-p")) prov=argv[++i];
    else if(!strcmp(argv[i],"-z")) size=strtoull(argv[++i],0,0);
    else if(!strcmp(argv[i],"-n")) iters=atol(argv[++i]);
    else if(!strcmp(argv[i],"-d")) depth=atoi(argv[++i]);
    else if(!strcmp(argv[i],"-r")) rd=1;
    else if(!strcmp(argv[i],"-b")) blocks=strtoull(argv[++i],0,0);
    else if(!strcmp(argv[i],"-D")) dc=1;
    else if(!strcmp(argv[i],"-L")) lat=1;
  }
  if (lat) { size = 16; blocks = 1; }
  struct fi_info *hints = fi_allocinfo(), *info;
  hints->ep_attr->type = FI_EP_RDM;
  hints->caps = FI_RMA | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE;
  hints->mode = FI_CONTEXT;
  hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
  hints->fabric_attr->prov_name = strdup(prov);
  if (dc) hints->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
  // IPv4 addresses where the provider has them (shm names its endpoints).
  if (strcmp(prov, "shm")) hints->addr_format = FI_SOCKADDR_IN;
  CK(fi_getinfo(FI_VERSION(1, 9), NULL, NULL, 0, hints, &info));
  struct fid_fabric *fab; struct fid_domain *dom; struct fid_ep *ep; struct fid_cq *cq; struct fid_av *av;
  CK(fi_fabric(info->fabric_attr, &fab, NULL));
  CK(fi_domain(fab, info, &dom, NULL));
  struct fi_cq_attr cqa = { .format = FI_CQ_FORMAT_CONTEXT, .size = 1024 };
  CK(fi_cq_open(dom, &cqa, &cq, NULL));
  struct fi_av_attr ava = { .type = FI_AV_TABLE };
  CK(fi_av_open(dom, &ava, &av, NULL));
  CK(fi_endpoint(dom, info, &ep, NULL));
  CK(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV));
  CK(fi_ep_bind(ep, &av->fid, 0));
  CK(fi_enable(ep));
  uint64_t mrm = info->domain_attr->mr_mode;
  if (blocks < 1) blocks = 1;
  size_t total = size * blocks;
  char *buf; if (posix_memalign((void**)&buf, 4096, total)) return 1; memset(buf, server ? 0 : 0x5a, total);
  struct fid_mr *mr;
  CK(fi_mr_reg(dom, buf, total, FI_READ|FI_WRITE|FI_REMOTE_READ|FI_REMOTE_WRITE, 0, 42, 0, &mr, NULL));
  if (mrm & FI_MR_ENDPOINT) { CK(fi_mr_bind(mr, &ep->fid, 0)); CK(fi_mr_enable(mr)); }
  void *desc = fi_mr_desc(mr);
  struct xchg me = { .namelen = sizeof me.name, .addr = (mrm & FI_MR_VIRT_ADDR) ? (uint64_t)(uintptr_t)buf : 0, .key = fi_mr_key(mr) }, peer;
  CK(fi_getname(&ep->fid, me.name, &me.namelen));
  int fd;
  if (server) {
    int l = socket(AF_INET, SOCK_STREAM, 0), one = 1; setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    if (bind(l, (void*)&a, sizeof a) || listen(l, 1)) { perror("listen"); return 1; }
    fd = accept(l, NULL, NULL);
  } else {
    fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port) }; inet_pton(AF_INET, host, &a.sin_addr);
    if (connect(fd, (void*)&a, sizeof a)) { perror("connect"); return 1; }
  }
  full(fd, &me, sizeof me, 1); full(fd, &peer, sizeof peer, 0);
  fi_addr_t pa; if (fi_av_insert(av, peer.name, 1, &pa, 0, NULL) != 1) { fprintf(stderr, "av_insert\n"); return 1; }
  struct fi_cq_entry ce[16];
  if (lat) {
    // The word at offset 0 receives, the one at 8 is sent from.
    volatile uint64_t *in = (volatile uint64_t *)buf;
    uint64_t *out = (uint64_t *)(buf + 8);
    *in = 0;
    char c = 0; full(fd, &c, 1, 1); full(fd, &c, 1, 0); // both sides registered and zeroed
    long warm = iters / 10, n = iters + warm; double *rt = malloc(sizeof(double) * n), t = 0;
    for (long i = 0; i < n; i++) {
      uint64_t want = 2 * (uint64_t)i + (server ? 1 : 2);
      if (server) while (*in != want) (void)fi_cq_read(cq, ce, 16);
      if (!server) t = now();
      *out = server ? want + 1 : want - 1;
      ssize_t r;
      while ((r = fi_write(ep, out, 8, desc, pa, peer.addr, peer.key, NULL)) == -FI_EAGAIN) (void)fi_cq_read(cq, ce, 0);
      if (r) { fprintf(stderr, "post %zd %s\n", r, fi_strerror(-r)); return 1; }
      for (;;) {
        ssize_t k = fi_cq_read(cq, ce, 1);
        if (k == 1) break;
        if (k != -FI_EAGAIN) { struct fi_cq_err_entry e = {0}; fi_cq_readerr(cq, &e, 0); fprintf(stderr, "cq %zd %s\n", k, fi_strerror(e.err)); return 1; }
      }
      if (!server) { while (*in != want) (void)fi_cq_read(cq, ce, 16); rt[i] = now() - t; }
    }
    full(fd, &c, 1, 1); full(fd, &c, 1, 0);
    if (server) return 0;
    qsort(rt + warm, iters, sizeof(double), by_value);
    printf("{\"prov\":\"%s\",\"op\":\"pingpong\",\"delivery_complete\":%d,\"iters\":%ld,\"us\":%.3f}\n", info->fabric_attr->prov_name, dc, iters, rt[warm + iters / 2] / 2 * 1e6);
    return 0;
  }
  if (server) {
    // Manual data progress: the target polls its queue until the client says done.
    fcntl(fd, F_SETFL, O_NONBLOCK); char c;
    for (;;) { (void)fi_cq_read(cq, ce, 16); ssize_t k = read(fd, &c, 1); if (k == 1 || k == 0) break; }
    printf("server: first byte %#x last byte %#x\n", (unsigned char)buf[0], (unsigned char)buf[total-1]);
    return 0;
  }
  long posted = 0, done = 0; double t0 = 0; long warm = iters / 10;
  while (done < iters + warm) {
    while (posted < iters + warm && posted - done < depth) {
      size_t off = (size_t)(posted % (long)blocks) * size;
      ssize_t r = rd ? fi_read(ep, buf + off, size, desc, pa, peer.addr + off, peer.key, NULL)
                     : fi_write(ep, buf + off, size, desc, pa, peer.addr + off, peer.key, NULL);
      if (r == -FI_EAGAIN) { (void)fi_cq_read(cq, ce, 0); break; }
      if (r) { fprintf(stderr, "post %zd %s\n", r, fi_strerror(-r)); return 1; }
      posted++;
    }
    ssize_t n = fi_cq_read(cq, ce, 16);
    if (n > 0) { done += n; if (done >= warm && t0 == 0) t0 = now(); }
    else if (n != -FI_EAGAIN) { struct fi_cq_err_entry e = {0}; fi_cq_readerr(cq, &e, 0); fprintf(stderr, "cq %zd %s\n", n, fi_strerror(e.err)); return 1; }
  }
  double dt = now() - t0;
  printf("{\"prov\":\"%s\",\"op\":\"%s\",\"delivery_complete\":%d,\"blocks\":%zu,\"size\":%zu,\"iters\":%ld,\"mr_mode\":%llu,\"key\":%llu,\"gb_per_s\":%.4f}\n", info->fabric_attr->prov_name, rd ? "read" : "write", dc, blocks, size, iters, (unsigned long long)mrm, (unsigned long long)peer.key, (double)size * iters / dt / 1e9);
  char c = 1; full(fd, &c, 1, 1);
  return 0;
}
