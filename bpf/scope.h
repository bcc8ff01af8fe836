/* Scope: the programs masquerade only what the node's IP stack sent or forwarded, as iptables'
 * POSTROUTING sees it. Other frames pass the uplink's tc hooks too, and are left untouched:
 *
 *   - VLAN-tagged frames: a VLAN sub-interface's (skb->vlan_present: the tag travels beside the
 *     frame; a tag in the frame, ETH_P_8021Q, is not IP to the parser). A sub-interface that is
 *     an uplink itself gets the programs on its own hooks, untagged.
 *   - frames of macvlan children (Multus secondary networks, in their own namespaces): their
 *     transmit path hands them to the uplink without the node's stack, and they carry the
 *     child's MAC as their source, where the node's stack writes the uplink's own.
 *   - frames of ipvlan children in L2 mode: they carry the uplink's MAC, but the node's stack
 *     neither received them (skb->ingress_ifindex is 0, as for the node's own packets) nor owns
 *     their source address. Packet sockets on the uplink (a DHCP client's discover from
 *     0.0.0.0) are left alone for the same reason.
 *
 * Measured at the uplink's tc egress in namespaces (veth uplink; forwarding on):
 *
 *   sender                         ingress_ifindex  source MAC  source address
 *   node socket                    0                uplink's    the uplink's, or another of the node's
 *   pod, forwarded                 the pod's veth   uplink's    the pod's
 *   macvlan child (bridge mode)    0                child's     the child's
 *   AF_PACKET socket on the uplink 0                as written  as written (0.0.0.0 for DHCP)
 *
 * ipvlan in L3 and L3S mode routes its children's packets through the node's POSTROUTING, where
 * iptables masquerades them; at tc they look like L2 mode's, and are left untouched too.
 *
 * What the node sends from any of its own addresses is host traffic, as from the uplink's: never
 * translated (bar a port a pod mapping holds), whatever the datapath saw of its flow. Its
 * requests may have come by a device without the programs, or before they ran; conntrack saw
 * them, the programs cannot have. A new flow from another address of the node keeps it, where
 * MASQUERADE would rewrite it to the uplink's.
 *
 * The scope is decided when a flow is created, as conntrack decides a connection's NAT on its
 * first packet; later packets follow the flow's NAT entry. */
#pragma once

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <bpf/bpf_helpers.h>

#include "maps.h"
#include "flow.h"
#include "parse.h"
#include "policy.h"

#define AF_INET 2
#define AF_INET6 10

static __always_inline const __be32 *uplink_addr(const struct uplink *u, const int v6)
{
	if (!u || !(v6 ? u->has_v6 : u->has_v4))
		return 0;
	return v6 ? WORDS(u->v6) : WORDS(u->v4);
}

/* The SNAT address of the family on an uplink, the one reader of the masquerade address: the
 * family's masqueradeAddress (nat_config's family_cfg.snat), else the uplink's own (uplink_snat).
 * snat_addr of the packet's device, uplink_snat_of of an ifindex read once (a second read of
 * skb->ifindex along one path can come out of clang as a load through a moved context pointer,
 * which the verifier refuses). */
static __always_inline const __be32 *uplink_snat_of(__u32 ifindex, const int v6)
{
	__u32 zero = 0;
	const struct nat_config *cfg = bpf_map_lookup_elem(&nat_config, &zero);
	const __be32 *masq = cfg ? snat_of(v6, family_cfg(cfg, v6)->snat) : 0;

	return masq ? masq : uplink_addr(bpf_map_lookup_elem(&uplink_snat, &ifindex), v6);
}

static __always_inline const __be32 *snat_addr(const struct __sk_buff *skb, const int v6)
{
	return uplink_snat_of(skb->ifindex, v6);
}

/* node_owns tells whether addr is an address of the node: a local route (the FIB says a packet
 * to it would not be forwarded). The unspecified address (a DHCP client's) is nobody's. The FIB
 * says "not forwarded" of an address it has no route to at all too, which a node with a default
 * route has for none; and a lookup the kernel refuses (forwarding off on the uplink) tells
 * nothing: either way the address counts as the node's (for a source: host traffic, which stays
 * as it is). */
static __always_inline int node_owns(struct __sk_buff *skb, const __be32 *addr, const int v6)
{
	struct bpf_fib_lookup fib = {.ifindex = skb->ifindex};
	long rc;

	if (!(addr[0] | (v6 ? addr[1] | addr[2] | addr[3] : 0)))
		return 0; /* 0.0.0.0 or :: */
	if (v6) {
		fib.family = AF_INET6;
		__builtin_memcpy(fib.ipv6_dst, addr, 16);
	} else {
		fib.family = AF_INET;
		fib.ipv4_dst = addr[0];
	}
	rc = bpf_fib_lookup(skb, &fib, sizeof(fib), 0);
	return rc == BPF_FIB_LKUP_RET_NOT_FWDED || rc == BPF_FIB_LKUP_RET_FWD_DISABLED || rc < 0;
}

/* mac_is reads the frame's source MAC (2-byte aligned in the Ethernet header) against mac. */
static __always_inline int source_mac_is(const struct __sk_buff *skb, const __u8 *mac)
{
	void *data = (void *)(long)skb->data, *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	const __u16 *a, *b = (const __u16 *)mac;

	if ((void *)(eth + 1) > data_end)
		return 0;
	a = (const __u16 *)eth->h_source;
	return a[0] == b[0] && a[1] == b[1] && a[2] == b[2];
}

/* routes_back tells whether the source of a packet the node received on device iif and routed out
 * here, by the uplink, is routed back by that device (the FIB's answer for a packet to it arriving there): a
 * reverse path check, which the packets the node forwards from its pods pass, and those of a
 * macvlan child that routes (received by a device of its own namespace, whose ifindex means
 * nothing here) fail, but where that ifindex is a device of the node that routes the child's
 * source. A packet received on the uplink itself is not a pod's. */
static __always_inline int routes_back(struct __sk_buff *skb, const struct pkt *p, const int v6, __u32 iif,
				       __u32 uplink)
{
	struct bpf_fib_lookup fib = {.ifindex = iif};
	long rc;

	if (iif == uplink)
		return 0;
	if (v6) {
		fib.family = AF_INET6;
		__builtin_memcpy(fib.ipv6_dst, p->saddr, 16);
	} else {
		fib.family = AF_INET;
		fib.ipv4_dst = p->saddr[0];
	}
	rc = bpf_fib_lookup(skb, &fib, sizeof(fib), 0);
	return (rc == BPF_FIB_LKUP_RET_SUCCESS || rc == BPF_FIB_LKUP_RET_NO_NEIGH) && fib.ifindex == iif;
}

/* Where a packet leaving by the uplink comes from (from_node_stack). */
enum origin {
	FROM_ELSEWHERE = 0, /* not the node's stack: a macvlan or ipvlan child's, a packet socket's */
	FROM_POD = 1,       /* received by a device of the node and routed out here: a pod's */
	FROM_HOST = 2,      /* sent by the node from one of its own addresses: host traffic, on any
			     * of them (a VIP, a secondary address, another device's) as on the
			     * uplink's */
};

/* from_node_stack tells where the first packet of a new flow leaving by the uplink comes from
 * (see the top of the file); snat is the uplink's address of the family, if any. A device whose
 * MAC userspace did not record is not checked for it. A frame of another source MAC is bridged
 * onto the uplink (a macvlan child's), or the node's own while the uplink's MAC changed and
 * userspace has not followed yet (a bond failing over with fail_over_mac=active takes its new
 * active slave's MAC): what the node forwarded then passes the reverse path check, so that no
 * pod's new flow leaves with its address meanwhile. */
static __always_inline int from_node_stack(struct __sk_buff *skb, const struct pkt *p, const int v6,
					   const __be32 *snat)
{
	__u32 ifindex = skb->ifindex, iif;
	const struct uplink_mac *mac = bpf_map_lookup_elem(&uplink_macs, &ifindex);

	if (mac && !source_mac_is(skb, mac->addr)) {
		iif = ingress_ifindex(skb);
		return iif && routes_back(skb, p, v6, iif, ifindex) ? FROM_POD : FROM_ELSEWHERE;
	}
	if (snat && addr_eq(v6, p->saddr, snat))
		return FROM_HOST; /* the uplink's address, sent or (a DNAT's reply) forwarded */
	if (ingress_ifindex(skb))
		return FROM_POD; /* received by a device of the node and routed out here */
	return node_owns(skb, p->saddr, v6) ? FROM_HOST : FROM_ELSEWHERE;
}
