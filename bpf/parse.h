/* Packet parsing: Ethernet, IPv4/IPv6 (IPv6 extension headers walked) and the L4 fields the NAT
 * needs. Every IP protocol is classified (enum l4):
 *
 *   - ports at offsets 0 and 2: TCP, UDP, UDP-Lite, DCCP and SCTP, as conntrack tracks them;
 *   - ICMP and ICMPv6 queries, whose identifier plays the port: echo, timestamp, information,
 *     address mask (ICMP), echo and node information (ICMPv6), conntrack's list;
 *   - ICMP and ICMPv6 errors, which quote a packet: destination unreachable, source quench,
 *     redirect, time exceeded, parameter problem (ICMP), every type below 128 (ICMPv6);
 *   - later fragments, which have no L4 header;
 *   - every other protocol (GRE, ESP, AH, IP in IP, unknown numbers): address-only NAT, as
 *     conntrack's generic tracking does, one mapping per protocol, remote and source;
 *   - the ICMP types conntrack does not track (neighbour and router discovery, MLD, the rest),
 *     which pass untouched, as they pass iptables;
 *   - untranslatable (L4_UNSAFE): an L4 header cut short by the packet, more IPv6 extension
 *     headers than IPV6_EXT_MAX or one cut short, the first fragment of an SCTP datagram (its
 *     CRC covers bytes the fragment does not hold). The NAT cannot find their flow nor rewrite
 *     them: egress drops the pod's of them whose destination is masqueraded, rather than send
 *     them with the pod's address (masq.c).
 *
 * A frame that is not IP, or whose IP header is unusable (another version, a header length too
 * small, options or the IPv6 header beyond the packet), is not parsed: it passes unchanged (the
 * kernel forwards no such packet, and one a raw socket of the node built carries its address).
 * Nothing is ever rewritten from a partial header.
 *
 * Cut short means by the skb or by the IP packet's own length: on ingress a short frame carries
 * Ethernet padding after the IP packet, which is no header. */
#pragma once

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <linux/icmpv6.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "compat.h"

/* The verdict of every path that neither drops nor redirects: TC_ACT_UNSPEC, which tcx calls
 * TCX_NEXT, runs the next program of the hook (a tcx link after ours, then the clsact filters)
 * and passes the packet at the end of the chain. TC_ACT_OK would end the chain there and starve
 * every neighbour after us. */
#define TC_NEXT TC_ACT_UNSPEC

/* ICMPv4 types (linux/icmp.h drags in socket headers the BPF target has no use for). */
#define ICMP_ECHOREPLY 0
#define ICMP_DEST_UNREACH 3
#define ICMP_SOURCE_QUENCH 4
#define ICMP_REDIRECT 5
#define ICMP_ECHO 8
#define ICMP_TIME_EXCEEDED 11
#define ICMP_PARAMETERPROB 12
#define ICMP_TIMESTAMP 13
#define ICMP_TIMESTAMPREPLY 14
#define ICMP_INFO_REQUEST 15
#define ICMP_INFO_REPLY 16
#define ICMP_ADDRESS 17
#define ICMP_ADDRESSREPLY 18
/* ICMPv6 node information query and reply (RFC 4620). */
#define ICMPV6_NI_QUERY 139
#define ICMPV6_NI_REPLY 140

/* Protocols with ports besides TCP and UDP, and the IPv6 extension headers. */
#define IPPROTO_DCCP_ 33
#define IPPROTO_SCTP_ 132
#define IPPROTO_UDPLITE_ 136
#define NEXTHDR_HOP 0
#define NEXTHDR_ROUTING 43
#define NEXTHDR_FRAGMENT 44
#define NEXTHDR_AUTH 51
#define NEXTHDR_DEST 60

/* skb->pkt_type of a packet addressed to this host (linux/if_packet.h). */
#define PACKET_HOST 0

/* test_ingress_in_cb is set only by pkg/bpf's tests, where this kernel's BPF_PROG_TEST_RUN
 * cannot set ingress_ifindex (5.10 refuses it): they pass the device a packet came in by in
 * cb[0] instead. The agent never sets it, and the verifier, which knows the constant, drops
 * the branch. */
volatile const __u32 test_ingress_in_cb = 0;

/* ingress_ifindex is the device the node received the packet by (0: the node sent it):
 * skb->ingress_ifindex, the one reader of it. */
static __always_inline __u32 ingress_ifindex(const struct __sk_buff *skb)
{
	/* Both read, each at a constant offset from the context pointer, the only form of context
	 * access the verifier accepts: the barriers keep clang from turning the choice into one
	 * load through a computed address. */
	__u32 in_cb = skb->cb[0], iif = skb->ingress_ifindex;

	barrier_var(in_cb);
	barrier_var(iif);
	return test_ingress_in_cb ? in_cb : iif;
}

/* Every field the NAT reads or writes lies within the first 8 bytes of ICMP, UDP, UDP-Lite,
 * DCCP and ICMPv6 headers, the first 12 of SCTP and the first 20 of TCP. */
#define ICMP_HLEN 8
#define TCP_HLEN_MIN 20
#define UDP_HLEN 8
#define SCTP_HLEN 12
#define L4_HLEN_MAX TCP_HLEN_MIN

#define IP_MF 0x2000
#define IP_OFFMASK 0x1fff

/* IPv6 fragment header (RFC 8200 4.5). */
#define IP6_MF 0x0001
#define IP6_OFFMASK 0xfff8

/* The most IPv6 extension headers walked before the upper-layer header; a packet with more is
 * untranslatable. The kernel walks any number; no packet of a real stack carries more than a
 * few (hop-by-hop, destination options, routing, fragment, destination options, AH). */
#define IPV6_EXT_MAX 8

struct frag6_hdr {
	__u8 nexthdr;
	__u8 reserved;
	__be16 frag_off;
	__be32 id;
};

enum frag {
	FRAG_NONE = 0,
	FRAG_FIRST = 1, /* offset 0, more fragments: carries the L4 header */
	FRAG_LATER = 2, /* no L4 header */
};

enum l4 {
	L4_PORTS = 1,      /* TCP, UDP, UDP-Lite, DCCP, SCTP */
	L4_ECHO = 2,       /* ICMP(v6) query or its reply: the identifier is the port */
	L4_ICMP_ERROR = 3, /* ICMP(v6) error quoting a packet */
	L4_NONE = 4,       /* later fragment */
	L4_ADDR = 5,       /* no ports: address-only NAT */
	L4_UNTRACKED = 6,  /* an ICMP type conntrack does not track: passes untouched */
	L4_UNSAFE = 7,     /* untranslatable (see the top of the file) */
};

/* How the L4 checksum covers what the NAT rewrites. */
enum csum {
	CSUM_NONE = 0,   /* none over the addresses or the ports (address-only protocols) */
	CSUM_INET = 1,   /* one's complement over the L4 message only: ICMPv4 */
	CSUM_PSEUDO = 2, /* one's complement with the pseudo-header: TCP, UDP, UDP-Lite, DCCP, ICMPv6 */
	CSUM_CRC32C = 3, /* SCTP: CRC32c over the SCTP packet, no pseudo-header */
};

struct pkt {
	__be32 saddr[4]; /* IPv4 in [0], the rest zero */
	__be32 daddr[4];
	__be16 sport; /* echo: a request carries the id here */
	__be16 dport; /* echo: a reply carries the id here */
	__u32 l4_off;
	__u32 end; /* offset where the IP packet ends: its own length, at most skb->len */
	__u32 len; /* IP packet length (skb->len without the Ethernet header) */
	__u8 proto;
	__u8 l4;        /* enum l4 */
	__u8 frag;      /* enum frag */
	__u8 tcp_flags; /* FIN 0x01, SYN 0x02, RST 0x04, ACK 0x10 */
	__u8 echo_request;
	__u8 csum;      /* enum csum */
	__u8 csum_off;  /* offset of the L4 checksum in the L4 header */
	__be32 frag_id; /* datagram id: IPv4 (16 bits) or IPv6 fragment header */
	__u8 transit;   /* IPv6 routing header with segments left: not at its destination yet */
	__u8 tcp_hlen;  /* TCP header bytes, options included */
	__u16 tcp_win;  /* the TCP window field as sent */
	/* TCP, host byte order: what flow tracking reads (bpf/tcp.h). */
	__u32 tcp_seq;
	__u32 tcp_ack;
	__u32 tcp_len;  /* payload bytes */
};

#define TCPF_FIN 0x01
#define TCPF_SYN 0x02
#define TCPF_RST 0x04
#define TCPF_ACK 0x10

/* The packet being handled, per CPU: the entry points parse it here (parse_packet), and the
 * global functions they call, which take no pointer but the skb, read it here (see masq.c). Like
 * the scratch (flow.h), it holds nothing from one run to the next: not pinned, in no layout. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct pkt);
} cpu_packet SEC(".maps");

static __always_inline struct pkt *packet(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&cpu_packet, &zero);
}

/* Enough linear data for Ethernet, the largest IPv4 header (or IPv6 with a fragment header)
 * and a TCP header. */
#define PULL_LEN (ETH_HLEN + 60 + TCP_HLEN_MIN)

/* pull_off is an offset already found no larger than PULL_LEN, bounded again: 6.12's verifier
 * walks the branch of that check that it should know is dead (an offset past PULL_LEN), finds
 * bounds there that contradict each other, forgets them, and then refuses packet-pointer math
 * with the offset. */
#define PULL_MASK 0x7f
_Static_assert(PULL_LEN <= PULL_MASK, "PULL_MASK must cover PULL_LEN");

static __always_inline __u32 pull_off(__u32 off)
{
	return masked(off, PULL_MASK);
}

static __always_inline int is_icmp(__u8 proto)
{
	return proto == IPPROTO_ICMP || proto == IPPROTO_ICMPV6;
}

/* Offset of the source (source=1) or destination port, or of the echo identifier, within the
 * L4 header. */
static __always_inline __u32 l4_port_off(__u8 proto, int source)
{
	if (is_icmp(proto))
		return 4;
	return source ? 0 : 2;
}

/* icmp_kind classifies an ICMP (v6 = 0) or ICMPv6 type: L4_ECHO with *request set for a
 * query, L4_ECHO for its reply, L4_ICMP_ERROR, or L4_UNTRACKED. */
static __always_inline __u8 icmp_kind(const int v6, __u8 type, __u8 *request)
{
	if (v6) {
		if (type < 128)
			return L4_ICMP_ERROR;
		if (type == ICMPV6_ECHO_REQUEST || type == ICMPV6_NI_QUERY)
			*request = 1;
		else if (type != ICMPV6_ECHO_REPLY && type != ICMPV6_NI_REPLY)
			return L4_UNTRACKED;
		return L4_ECHO;
	}
	switch (type) {
	case ICMP_ECHO:
	case ICMP_TIMESTAMP:
	case ICMP_INFO_REQUEST:
	case ICMP_ADDRESS:
		*request = 1;
		return L4_ECHO;
	case ICMP_ECHOREPLY:
	case ICMP_TIMESTAMPREPLY:
	case ICMP_INFO_REPLY:
	case ICMP_ADDRESSREPLY:
		return L4_ECHO;
	case ICMP_DEST_UNREACH:
	case ICMP_SOURCE_QUENCH:
	case ICMP_REDIRECT:
	case ICMP_TIME_EXCEEDED:
	case ICMP_PARAMETERPROB:
		return L4_ICMP_ERROR;
	}
	return L4_UNTRACKED;
}

/* load reads len bytes (a constant) at off: straight from the linear data when it holds them,
 * else with bpf_skb_load_bytes (headers behind IPv6 extension headers, or in paged data). */
static __always_inline int load(struct __sk_buff *skb, __u32 off, void *to, const __u32 len)
{
	void *data = (void *)(long)skb->data, *data_end = (void *)(long)skb->data_end;
	void *from;

	if (off > PULL_LEN)
		return bpf_skb_load_bytes(skb, off, to, len);
	from = data + pull_off(off);
	if (from + len > data_end)
		return bpf_skb_load_bytes(skb, off, to, len);
	__builtin_memcpy(to, from, len);
	return 0;
}

/* parse_l4 reads the L4 part once the L3 header is known: the kind (enum l4), ports, TCP flags,
 * the checksum's kind and place. A first fragment or whole packet whose L4 header is cut short
 * is untranslatable. */
static __always_inline void parse_l4(struct __sk_buff *skb, struct pkt *p, const int v6)
{
	__u8 h[L4_HLEN_MAX];
	__u32 need = UDP_HLEN;

	switch (p->proto) {
	case IPPROTO_TCP:
		need = TCP_HLEN_MIN;
		break;
	case IPPROTO_SCTP_:
		need = SCTP_HLEN;
		break;
	case IPPROTO_UDP:
	case IPPROTO_UDPLITE_:
	case IPPROTO_DCCP_:
	case IPPROTO_ICMP:
	case IPPROTO_ICMPV6:
		break;
	default:
		p->l4 = L4_ADDR; /* p->csum is CSUM_NONE */
		return;
	}
	/* A packet with all of L4_HLEN_MAX bytes there is read at once; a shorter one (a UDP header
	 * at the end of the frame) as much as its protocol needs. */
	if (p->l4_off + need > p->end || (load(skb, p->l4_off, h, L4_HLEN_MAX) < 0 &&
					  bpf_skb_load_bytes(skb, p->l4_off, h, need) < 0)) {
		p->l4 = L4_UNSAFE;
		return;
	}
	switch (p->proto) {
	case IPPROTO_ICMP:
	case IPPROTO_ICMPV6:
		if ((p->proto == IPPROTO_ICMP) != !v6) {
			p->l4 = L4_ADDR; /* ICMPv4 in IPv6 or the reverse: a protocol like any other */
			return;
		}
		p->csum = v6 ? CSUM_PSEUDO : CSUM_INET;
		p->csum_off = 2;
		p->l4 = icmp_kind(v6, h[0], &p->echo_request);
		if (p->l4 == L4_ECHO) {
			if (p->echo_request)
				__builtin_memcpy(&p->sport, h + 4, 2);
			else
				__builtin_memcpy(&p->dport, h + 4, 2);
		}
		return;
	case IPPROTO_TCP:
		p->tcp_flags = h[13];
		p->tcp_seq = bpf_ntohl(*(__be32 *)(h + 4));
		p->tcp_ack = bpf_ntohl(*(__be32 *)(h + 8));
		p->tcp_win = bpf_ntohs(*(__be16 *)(h + 14));
		p->tcp_hlen = (h[12] >> 4) * 4;
		if (p->tcp_hlen >= TCP_HLEN_MIN && p->l4_off + p->tcp_hlen <= p->end)
			p->tcp_len = p->end - p->l4_off - p->tcp_hlen;
		p->csum_off = offsetof(struct tcphdr, check);
		p->csum = CSUM_PSEUDO;
		break;
	case IPPROTO_SCTP_:
		/* The CRC of a fragmented datagram covers bytes the first fragment does not hold:
		 * its port cannot be rewritten (SCTP avoids IP fragmentation). */
		if (p->frag == FRAG_FIRST) {
			p->l4 = L4_UNSAFE;
			return;
		}
		p->csum_off = 8;
		p->csum = CSUM_CRC32C;
		break;
	default: /* UDP, UDP-Lite, DCCP */
		p->csum_off = 6;
		p->csum = CSUM_PSEUDO;
	}
	__builtin_memcpy(&p->sport, h, 2);
	__builtin_memcpy(&p->dport, h + 2, 2);
	p->l4 = L4_PORTS;
}

/* headers_len is how much linear data parse may read of this packet: Ethernet, its IP header
 * (with options, or the IPv6 fragment header) and the largest L4 header read, TCP's. PULL_LEN
 * when the IP header itself is not there to tell. */
static __always_inline __u32 headers_len(void *data, void *data_end)
{
	struct ethhdr *eth = data;

	if ((void *)(eth + 1) > data_end)
		return PULL_LEN;
	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = data + ETH_HLEN;

		if ((void *)(ip + 1) > data_end)
			return PULL_LEN;
		return ETH_HLEN + ip->ihl * 4 + TCP_HLEN_MIN;
	}
	if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = data + ETH_HLEN;

		if ((void *)(ip6 + 1) > data_end)
			return PULL_LEN;
		return ETH_HLEN + sizeof(*ip6) + (ip6->nexthdr == NEXTHDR_FRAGMENT ? sizeof(struct frag6_hdr) : 0) +
		       TCP_HLEN_MIN;
	}
	return 0; /* not parsed */
}

/* ipv6_walk follows the extension headers from p->proto at p->l4_off, as the kernel's
 * ipv6_skip_exthdr does (hop-by-hop, routing, destination options, AH, fragment), up to the
 * upper-layer header: it sets p->proto and p->l4_off there, the fragment state, and whether a
 * routing header still has segments left. Returns -1 for an untranslatable chain. */
static __always_inline int ipv6_ext(__u8 nh)
{
	return nh == NEXTHDR_HOP || nh == NEXTHDR_ROUTING || nh == NEXTHDR_DEST || nh == NEXTHDR_AUTH ||
	       nh == NEXTHDR_FRAGMENT;
}

static __always_inline int ipv6_walk(struct __sk_buff *skb, struct pkt *p)
{
	__u8 nh = p->proto;
	__u32 off = p->l4_off;

	for (int i = 0; i < IPV6_EXT_MAX && ipv6_ext(nh); i++) {
		if (nh == NEXTHDR_FRAGMENT) {
			struct frag6_hdr fh;
			__u16 fo;

			if (off + sizeof(fh) > p->end || load(skb, off, &fh, sizeof(fh)) < 0)
				return -1;
			p->frag_id = fh.id;
			off += sizeof(fh);
			fo = bpf_ntohs(fh.frag_off);
			if (fo & IP6_OFFMASK) {
				/* A later fragment is remembered by the protocol after the fragment
				 * header: its datagram's first fragment is found when no extension
				 * header follows that one. */
				p->frag = FRAG_LATER;
				p->proto = fh.nexthdr;
				p->l4_off = off;
				return 0;
			}
			if (fo & IP6_MF)
				p->frag = FRAG_FIRST;
			nh = fh.nexthdr;
		} else {
			__u8 h[4]; /* next header, length, and (routing) type and segments left */

			if (off + 8 > p->end || load(skb, off, h, sizeof(h)) < 0)
				return -1;
			if (nh == NEXTHDR_ROUTING && h[3])
				p->transit = 1;
			off += nh == NEXTHDR_AUTH ? ((__u32)h[1] + 2) * 4 : ((__u32)h[1] + 1) * 8;
			nh = h[0];
		}
	}
	if (ipv6_ext(nh))
		return -1; /* more than IPV6_EXT_MAX */
	p->proto = nh;
	p->l4_off = off;
	return 0;
}

/* ipv6_walk on the packet being handled: a global function, which the verifier checks once
 * rather than going on from each of the ways the walk ends. */
__attribute__((noinline)) int ipv6_walk_at(struct __sk_buff *skb)
{
	struct pkt *p = packet();

	return p ? ipv6_walk(skb, p) : -1;
}

/* parse fills p, the packet being handled (packet()), for an IPv4 (returns 4) or IPv6 (returns
 * 6) packet, or returns a negative value for a frame to pass unchanged (not IP, or an unusable IP
 * header). */
static __always_inline int parse(struct __sk_buff *skb, struct pkt *p)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth;

	/* Headers normally sit in the linear part; pull them in only when this packet's do not.
	 * A pull beyond them moves payload into the head, and a TCP segment's head is shared with
	 * the sender's retransmit copy: the kernel would then copy the head of every segment
	 * (measured: 8% of bulk throughput). The rewrites themselves stay within the headers, which
	 * a TCP clone may write without a copy. */
	if (data + headers_len(data, data_end) > data_end && skb->len > data_end - data) {
		bpf_skb_pull_data(skb, skb->len < PULL_LEN ? skb->len : PULL_LEN);
		data = (void *)(long)skb->data;
		data_end = (void *)(long)skb->data_end;
	}

	eth = data;
	if ((void *)(eth + 1) > data_end)
		return -1;
	p->len = skb->len - ETH_HLEN;

	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = data + ETH_HLEN;
		__u16 frag;
		__u32 hlen, tot;

		if ((void *)(ip + 1) > data_end)
			return -1;
		hlen = ip->ihl * 4;
		if (ip->version != 4 || hlen < sizeof(*ip))
			return -1;
		/* A total length of 0 is IPv4 BIG TCP's (a GSO packet beyond 64k): the skb's counts. */
		tot = bpf_ntohs(ip->tot_len);
		p->end = skb->len;
		if (tot) {
			if (tot < hlen)
				return -1;
			if (ETH_HLEN + tot < p->end)
				p->end = ETH_HLEN + tot;
		}
		if (ETH_HLEN + hlen > p->end)
			return -1; /* options cut short */
		p->saddr[0] = ip->saddr;
		p->daddr[0] = ip->daddr;
		p->proto = ip->protocol;
		p->frag_id = ip->id;
		p->l4_off = ETH_HLEN + hlen;
		frag = bpf_ntohs(ip->frag_off);
		if (frag & IP_OFFMASK) {
			p->frag = FRAG_LATER;
			p->l4 = L4_NONE;
			return 4;
		}
		if (frag & IP_MF)
			p->frag = FRAG_FIRST;
		parse_l4(skb, p, 0);
		return 4;
	}

	if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = data + ETH_HLEN;

		if ((void *)(ip6 + 1) > data_end)
			return -1;
		if (ip6->version != 6)
			return -1;
		/* A payload length of 0 is a jumbogram's or IPv6 BIG TCP's: the skb's counts. */
		p->end = skb->len;
		if (ip6->payload_len && ETH_HLEN + sizeof(*ip6) + bpf_ntohs(ip6->payload_len) < p->end)
			p->end = ETH_HLEN + sizeof(*ip6) + bpf_ntohs(ip6->payload_len);
		if (ETH_HLEN + sizeof(*ip6) > p->end)
			return -1;
		__builtin_memcpy(p->saddr, &ip6->saddr, 16);
		__builtin_memcpy(p->daddr, &ip6->daddr, 16);
		p->proto = ip6->nexthdr;
		p->l4_off = ETH_HLEN + sizeof(*ip6);
		if (ipv6_walk_at(skb) < 0) {
			p->l4 = L4_UNSAFE;
			return 6;
		}
		if (p->frag == FRAG_LATER) {
			p->l4 = L4_NONE;
			return 6;
		}
		parse_l4(skb, p, 1);
		return 6;
	}
	return -1;
}

/* parse_packet parses the packet into packet(): parse. */
static __always_inline int parse_packet(struct __sk_buff *skb)
{
	struct pkt *p = packet();

	if (!p)
		return -1;
	*p = (struct pkt){};
	return parse(skb, p);
}
