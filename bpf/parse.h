/* Packet parsing: Ethernet, IPv4/IPv6 and the L4 fields the NAT needs. A packet that is not
 * IP, is truncated, or carries a protocol the NAT does not handle is reported as such and
 * passed on unchanged by the callers: nothing is ever rewritten from a partial header.
 *
 * Truncated means cut short by the skb or by the IP packet's own length: on ingress a short
 * frame carries Ethernet padding after the IP packet, which is no header. */
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

/* The verdict of every path that neither drops nor redirects: TC_ACT_UNSPEC, which tcx calls
 * TCX_NEXT, runs the next program of the hook (a tcx link after ours, then the clsact filters)
 * and passes the packet at the end of the chain. TC_ACT_OK would end the chain there and starve
 * every neighbour after us. */
#define TC_NEXT TC_ACT_UNSPEC

/* ICMPv4 types (linux/icmp.h drags in socket headers the BPF target has no use for). */
#define ICMP_ECHOREPLY 0
#define ICMP_DEST_UNREACH 3
#define ICMP_ECHO 8
#define ICMP_TIME_EXCEEDED 11

/* skb->pkt_type of a packet addressed to this host (linux/if_packet.h). */
#define PACKET_HOST 0

/* Every field the NAT reads or writes lies within the first 8 bytes of ICMP, UDP and ICMPv6
 * headers, and the first 20 of TCP. */
#define ICMP_HLEN 8
#define TCP_HLEN_MIN 20
#define UDP_HLEN 8

#define IP_MF 0x2000
#define IP_OFFMASK 0x1fff

/* IPv6 fragment header (RFC 8200 4.5). */
#define IPV6_FRAGMENT 44
#define IP6_MF 0x0001
#define IP6_OFFMASK 0xfff8

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
	L4_PORTS = 1,     /* TCP, UDP */
	L4_ECHO = 2,      /* ICMP(v6) echo request or reply: the identifier is the port */
	L4_ICMP_ERROR = 3, /* ICMP(v6) error quoting a packet */
	L4_NONE = 4,      /* later fragment */
};

struct pkt {
	__be32 saddr[4]; /* IPv4 in [0], the rest zero */
	__be32 daddr[4];
	__be16 sport; /* echo: request carries the id here */
	__be16 dport; /* echo: reply carries the id here */
	__u32 l4_off;
	__u32 end; /* offset where the IP packet ends: its own length, at most skb->len */
	__u32 len; /* IP packet length (skb->len without the Ethernet header) */
	__u8 proto;
	__u8 l4;       /* enum l4 */
	__u8 frag;     /* enum frag */
	__u8 tcp_flags; /* FIN 0x01, SYN 0x02, RST 0x04, ACK 0x10 */
	__u8 echo_request;
	__u8 pad[3];
	__be32 frag_id; /* datagram id: IPv4 (16 bits) or IPv6 fragment header */
};

#define TCPF_FIN 0x01
#define TCPF_SYN 0x02
#define TCPF_RST 0x04
#define TCPF_ACK 0x10

/* Enough linear data for Ethernet, the largest IPv4 header (or IPv6 with a fragment header)
 * and a TCP header. */
#define PULL_LEN (ETH_HLEN + 60 + TCP_HLEN_MIN)

static __always_inline int is_icmp(__u8 proto)
{
	return proto == IPPROTO_ICMP || proto == IPPROTO_ICMPV6;
}

/* Offsets of the L4 fields within the L4 header. */
static __always_inline __u32 l4_csum_off(__u8 proto)
{
	switch (proto) {
	case IPPROTO_TCP:
		return offsetof(struct tcphdr, check);
	case IPPROTO_UDP:
		return offsetof(struct udphdr, check);
	default: /* ICMP, ICMPv6 */
		return 2;
	}
}

static __always_inline __u32 l4_port_off(__u8 proto, int source)
{
	if (is_icmp(proto))
		return 4; /* the identifier */
	return source ? 0 : 2;
}

/* Reads the L4 part once the L3 header is known: ports, TCP flags, ICMP kind. */
static __always_inline int parse_l4(void *data, void *data_end, struct pkt *p, __u8 v6)
{
	void *l4 = data + p->l4_off;

	switch (p->proto) {
	case IPPROTO_TCP: {
		struct tcphdr *th = l4;

		if (l4 + TCP_HLEN_MIN > data_end || p->l4_off + TCP_HLEN_MIN > p->end)
			return -1;
		p->sport = th->source;
		p->dport = th->dest;
		p->tcp_flags = ((__u8 *)th)[13];
		p->l4 = L4_PORTS;
		return 0;
	}
	case IPPROTO_UDP: {
		struct udphdr *uh = l4;

		if (l4 + UDP_HLEN > data_end || p->l4_off + UDP_HLEN > p->end)
			return -1;
		p->sport = uh->source;
		p->dport = uh->dest;
		p->l4 = L4_PORTS;
		return 0;
	}
	case IPPROTO_ICMP:
	case IPPROTO_ICMPV6: {
		__u8 *ih = l4;
		__u8 type;

		if (l4 + ICMP_HLEN > data_end || p->l4_off + ICMP_HLEN > p->end)
			return -1;
		if ((p->proto == IPPROTO_ICMP) != !v6)
			return -1; /* ICMPv4 in IPv6 or the reverse */
		type = ih[0];
		if (v6) {
			if (type == ICMPV6_ECHO_REQUEST) {
				p->echo_request = 1;
				p->sport = *(__be16 *)(ih + 4);
			} else if (type == ICMPV6_ECHO_REPLY) {
				p->dport = *(__be16 *)(ih + 4);
			} else if (type == ICMPV6_DEST_UNREACH || type == ICMPV6_PKT_TOOBIG ||
				   type == ICMPV6_TIME_EXCEED) {
				p->l4 = L4_ICMP_ERROR;
				return 0;
			} else {
				return -1; /* neighbour discovery and the rest pass untouched */
			}
		} else {
			if (type == ICMP_ECHO) {
				p->echo_request = 1;
				p->sport = *(__be16 *)(ih + 4);
			} else if (type == ICMP_ECHOREPLY) {
				p->dport = *(__be16 *)(ih + 4);
			} else if (type == ICMP_DEST_UNREACH || type == ICMP_TIME_EXCEEDED) {
				p->l4 = L4_ICMP_ERROR;
				return 0;
			} else {
				return -1;
			}
		}
		p->l4 = L4_ECHO;
		return 0;
	}
	}
	return -1;
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
		return ETH_HLEN + sizeof(*ip6) + (ip6->nexthdr == IPV6_FRAGMENT ? sizeof(struct frag6_hdr) : 0) +
		       TCP_HLEN_MIN;
	}
	return 0; /* not parsed */
}

/* parse fills p for an IPv4 (returns 4) or IPv6 (returns 6) packet the NAT handles, or
 * returns a negative value for a packet to pass unchanged. */
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
			if (p->proto != IPPROTO_TCP && p->proto != IPPROTO_UDP && p->proto != IPPROTO_ICMP)
				return -1;
			p->frag = FRAG_LATER;
			p->l4 = L4_NONE;
			return 4;
		}
		if (frag & IP_MF)
			p->frag = FRAG_FIRST;
		if (parse_l4(data, data_end, p, 0) < 0)
			return -1;
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
		__builtin_memcpy(p->saddr, &ip6->saddr, 16);
		__builtin_memcpy(p->daddr, &ip6->daddr, 16);
		p->proto = ip6->nexthdr;
		p->l4_off = ETH_HLEN + sizeof(*ip6);
		/* A fragment header right after the fixed header is followed; other extension
		 * headers are not, and such packets pass unchanged. */
		if (p->proto == IPV6_FRAGMENT) {
			struct frag6_hdr *fh = (void *)(ip6 + 1);
			__u16 off;

			if ((void *)(fh + 1) > data_end || p->l4_off + sizeof(*fh) > p->end)
				return -1;
			p->proto = fh->nexthdr;
			p->frag_id = fh->id;
			p->l4_off += sizeof(*fh);
			off = bpf_ntohs(fh->frag_off);
			if (off & IP6_OFFMASK) {
				if (p->proto != IPPROTO_TCP && p->proto != IPPROTO_UDP && p->proto != IPPROTO_ICMPV6)
					return -1;
				p->frag = FRAG_LATER;
				p->l4 = L4_NONE;
				return 6;
			}
			if (off & IP6_MF)
				p->frag = FRAG_FIRST;
		}
		if (parse_l4(data, data_end, p, 1) < 0)
			return -1;
		return 6;
	}
	return -1;
}
