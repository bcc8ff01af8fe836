/* Types shared with the Go side (pkg/bpf, through bpf2go): every struct is laid out without
 * implicit padding, so the generated Go types have exactly the C layout. Addresses and ports
 * are kept in network byte order, as they appear in packets; addresses are byte arrays
 * (4-byte aligned, so that the programs read them as words), which bpftool prints as
 * [10,0,0,0] rather than as a little-endian integer.
 *
 * The structs of pinned maps are the pinned layout: changing one is a new layout, which needs a
 * migration from the old one (pkg/bpf/layout.go says how). */
#pragma once

#include <linux/types.h>

/* Verdicts, as policy.Action. */
enum __attribute__((packed)) action {
	ACTION_RETURN = 0,
	ACTION_MASQUERADE = 1,
};

/* Counter slot of a verdict that no rule gave (end of chain). */
#define NO_SLOT 0xffffffffu

#define ADDR_WORDS __attribute__((aligned(4)))

/* Key of the LPM tries (masq_v4, nomasq_v4, masq_v6, nomasq_v6). */
struct lpm4_key {
	__u32 prefixlen;
	__u8 addr[4];
};

struct lpm6_key {
	__u32 prefixlen;
	__u8 addr[16];
};

/* Value of the LPM tries, for the addresses whose longest match is this entry: the verdict, and
 * the counter slot of the rule a first-match chain decides them by (the first rule among this
 * prefix and the shorter prefixes of the same trie that contain it). snat is the masquerade
 * address of that rule where it is the rule's own (a masqueradeCIDRs entry's, other than the
 * family's masqueradeAddress), which a new masqueraded flow is translated to; all zero means the
 * family's or the uplink's (bpf/scope.h: uplink_snat_of). Earlier agents wrote the family's
 * masqueradeAddress here too, which gives the same address. */
struct lpm4_val {
	__u32 slot;
	enum action action;
	__u8 pad[3];
	__u8 snat[4] ADDR_WORDS;
};

struct lpm6_val {
	__u32 slot;
	enum action action;
	__u8 pad[3];
	__u8 snat[16] ADDR_WORDS;
};

/* Per family settings: the outbound rule (rule 4 of the chain), and snat, the family's
 * masqueradeAddress (IPv4 in the first 4 bytes; all zero: none, each uplink's own address): the
 * one place the programs read it (bpf/scope.h: uplink_snat_of), for every uplink. Agents before
 * this one wrote it zero, and the address into uplink_snat. */
struct family_cfg {
	__u8 enabled;  /* 0: the family is left alone (e.g. IPv6 without --enable-ipv6) */
	enum action outbound; /* for destinations no trie matched */
	__u8 pad[2];
	__u32 out_slot; /* counter slot of the outbound rule, or NO_SLOT */
	__u8 snat[16] ADDR_WORDS;
};

/* Source rules (sourceRules): each has an id (1-based, kept by its name across syncs; 0 is the
 * global lists), src_v4/src_v6 map a source prefix to the id of the first rule that holds its
 * addresses (the longest match gives the first-match rule: policy.SourceTable), and the rule's
 * own lists live in the rule tries (rmasq_v4, rnomasq_v4, ...) under its id. */
#define MAX_SOURCE_IDS 2048 /* ids 1..2047: a sync's new rules take ids its removed ones did not hold */
#define SOURCE_NAME_LEN 48

/* Value of the source tries: the id of the rule that decides the addresses. */
struct src_val {
	__u32 rule;
};

/* Key of the rule tries: a rule's id, then a destination prefix; prefixlen counts the id's 32
 * bits too (32 + the prefix's bits), so that a lookup matches the rule's own entries only. The
 * id is always matched whole, so its byte order does not matter: it is kept in host order, as
 * bpftool prints it. */
struct rlpm4_key {
	__u32 prefixlen;
	__u32 rule;
	__u8 addr[4];
};

struct rlpm6_key {
	__u32 prefixlen;
	__u32 rule;
	__u8 addr[16];
};

#define MAX_PORT_RANGES 16
#define NAT_PORTS_MAX 65536

struct port_range {
	__u16 first; /* host byte order, inclusive */
	__u16 last;
};

/* The single value of the nat_config array. */
struct nat_config {
	struct family_cfg v4;
	struct family_cfg v6;
	__u8 random_fully; /* 1: random ports; 0: keep the original port when free */
	__u8 nranges;
	__u16 pad;
	__u32 nports; /* sum of the range sizes: the entries of nat_ports in use */
	__u32 port_seed; /* secret of the per-endpoint port sequences (nat_alloc), chosen once per node */
	struct port_range ranges[MAX_PORT_RANGES]; /* as configured, for port_in_ranges and dumps */
};

/* A source rule's settings (src_cfg, indexed by its id): what nat_config's family_cfg is to the
 * global lists (the outbound rule, its counter slot, the family's masquerade address: the rule's
 * own masqueradeAddress or else the global one), and its name, so that an agent that finds the
 * maps pinned keeps each rule's id (and its counters). An id no rule holds is all zero. */
struct src_rule {
	struct family_cfg v4;
	struct family_cfg v6;
	char name[SOURCE_NAME_LEN];
};

/* The SNAT addresses of an uplink (uplink_snat, keyed by ifindex): its own, or the family's
 * masqueradeAddress where there is one. The programs read the latter in nat_config, first; it is
 * written here too for the programs of earlier builds of this layout (attached during an upgrade
 * or after a rollback), which read it here, and the agent flushes the flows of an address when it
 * changes here. */
struct uplink {
	__u8 v4[4] ADDR_WORDS;
	__u8 v6[16] ADDR_WORDS;
	__u8 has_v4;
	__u8 has_v6;
	__u8 pad[2];
};

/* The MAC address of an uplink (uplink_macs, keyed by ifindex). */
struct uplink_mac {
	__u8 addr[6];
	__u8 pad[2];
};

/* Per-CPU, per-rule hit counters (rule_stats, indexed by slot). */
struct rule_stats {
	__u64 packets;
	__u64 bytes; /* IP packet lengths, as iptables counts them */
};

enum __attribute__((packed)) rule_origin {
	ORIGIN_MASQUERADE_CIDRS = 1,
	ORIGIN_LINK_LOCAL = 2,
	ORIGIN_NON_MASQUERADE_CIDRS = 3,
	ORIGIN_OUTBOUND = 4,
};

/* What a counter slot is assigned to (rule_slots, indexed by slot). Written by userspace only,
 * so that counters can be tied back to rules after an agent restart. */
struct rule_slot {
	__u8 addr[16] ADDR_WORDS; /* IPv4 in the first 4 bytes */
	__u8 prefixlen;
	__u8 family; /* 4 or 6; 0 = free slot */
	enum action action;
	enum rule_origin origin;
	__u16 dup;   /* n-th rule with the same identity (duplicates in the config) */
	__u16 pad;
};


/* Direction of a NAT table key: the egress key matches packets leaving through the uplink
 * (original tuple), the ingress key matches the packets that come back. */
enum __attribute__((packed)) nat_dir {
	DIR_EGRESS = 0,
	DIR_INGRESS = 1,
};

/* For ICMP echo the identifier plays the port: a request carries it as sport (dport 0), a
 * reply as dport (sport 0), so that request and reply keys mirror each other like ports do. */
struct nat4_key {
	__u8 saddr[4] ADDR_WORDS;
	__u8 daddr[4] ADDR_WORDS;
	__be16 sport;
	__be16 dport;
	__u8 proto;
	enum nat_dir dir;
	__u8 pad[2];
};

struct nat6_key {
	__u8 saddr[16] ADDR_WORDS;
	__u8 daddr[16] ADDR_WORDS;
	__be16 sport;
	__be16 dport;
	__u8 proto;
	enum nat_dir dir;
	__u8 pad[2];
};

/* What kind of flow a NAT entry belongs to. */
enum __attribute__((packed)) nat_kind {
	NAT_MASQ = 1,    /* masqueraded pod flow: a rule decided it */
	NAT_HOST = 2,    /* host socket on the uplink address: reserves its port (remapped if taken) */
	NAT_INBOUND = 3, /* connection opened from outside: its replies leave untouched */
};

/* Entry flags (bpf/nat.h has the flow-state design). FIN and RST, once plausible, and REPLIED are
 * set on both halves of a flow, so either half tells the flow's state. */
enum __attribute__((packed)) nat_flags {
	NAT_F_ORIG = 1,    /* this half's direction opened the flow */
	NAT_F_FIN = 2,     /* a FIN within the receiver's window went either way */
	NAT_F_RST = 4,     /* an RST the receiver would accept went either way */
	NAT_F_REPLIED = 8, /* the flow has carried a reply */
	NAT_F_ACK = 16,    /* TCP: ack and win hold this direction's latest acknowledgment */
	NAT_F_NOROOM = 32, /* the table of confirmed flows had no room for this flow when it proved two-way */
};

/* A TCP window scale not seen (the handshake of this direction happened elsewhere): the largest
 * TCP allows is assumed, as conntrack is liberal with connections it picks up midway. */
#define NAT_WSCALE_UNKNOWN 0xff

/* Value of both NAT entries of a flow. An egress entry holds the translated source (the
 * uplink address and the allocated port); an ingress entry holds the original source, which
 * replies get back as their destination. Either entry is enough to compute the other's key. */
struct nat_entry {
	__u8 addr[16] ADDR_WORDS; /* IPv4 in the first 4 bytes */
	__be16 port;
	enum nat_kind kind;
	enum nat_flags flags;
	__u32 slot; /* counter slot of the deciding rule (NAT_MASQ flows, both halves), else NO_SLOT */
	__u64 last_seen; /* bpf_ktime_get_ns (CLOCK_MONOTONIC), refreshed at most once a second */
	/* TCP, this half's direction, host byte order: the latest acknowledgment sent (valid with
	 * NAT_F_ACK) with its raw window and the window scale of this direction's SYN, and where the
	 * latest segment ended (sequence number plus length). What a FIN or RST is checked against. */
	__u32 ack;
	__u32 end;
	__u16 win;
	__u8 wscale;
	__u8 pad[5];
};

/* Value of the keep tables (keep_v4, keep_v6): a pod's flow that the policy left alone (RETURN),
 * keyed by its egress tuple. It keeps that verdict until it is idle for its timeout (TCP: closing
 * once the pod sent a FIN or RST) or a SYN opens the tuple again, whatever the policy says
 * meanwhile. */
struct keep_entry {
	__u32 slot;    /* counter slot of the deciding rule, or NO_SLOT */
	__u8 closing;  /* TCP: the pod sent a FIN or RST */
	__u8 pad[3];
	__u64 last_seen; /* as nat_entry's */
};

/* A later fragment has no ports: they are remembered from the first fragment, by datagram. */
struct frag4_key {
	__u8 saddr[4] ADDR_WORDS;
	__u8 daddr[4] ADDR_WORDS;
	__be16 id;
	__u8 proto;
	enum nat_dir dir;
};

struct frag6_key {
	__u8 saddr[16] ADDR_WORDS;
	__u8 daddr[16] ADDR_WORDS;
	__be32 id;
	__u8 proto;
	enum nat_dir dir;
	__u8 pad[2];
};

struct frag_ports {
	__be16 sport;
	__be16 dport;
};

/* Later fragments that come before their datagram's first fragment are held, their bytes kept,
 * until it comes (bpf/frag.h): up to FRAG_HELD_SLOTS of a datagram, each of at most
 * FRAG_HELD_BYTES (its Ethernet frame: a 9000-byte MTU's fits), for as long as the kernel's own
 * reassembly would wait (the userspace sweep removes older ones: pkg/bpf FragHoldTimeout). The
 * key is the datagram's and the fragment's slot. */
#define FRAG_HELD_SLOTS 64
#define FRAG_HELD_BYTES 9216

struct frag4_held_key {
	struct frag4_key dgram;
	__u8 slot;
	__u8 pad[3];
};

struct frag6_held_key {
	struct frag6_key dgram;
	__u8 slot;
	__u8 pad[3];
};

struct frag_held {
	__u64 held_at; /* bpf_ktime_get_ns */
	__u16 len;     /* bytes of data in use; 0 while being written */
	__u8 releasing; /* slot 0: the datagram's first fragment came, its held ones are being sent */
	__u8 pad[5];
	__u8 data[FRAG_HELD_BYTES];
};

/* The layout record (layout, entry 0), written by userspace when it creates the maps: which
 * layout of the pinned maps this is, for the agent that finds them pinned (pkg/bpf/layout.go). */
#define LAYOUT_MAGIC "ip-masq-agent"

struct layout {
	char magic[16]; /* LAYOUT_MAGIC */
	__u32 version;
};

/* Per-CPU event counters (event_stats, indexed by event). */
enum event {
	EV_NEW_MASQ = 0,      /* masquerade mappings created */
	EV_PORT_RETRY,        /* port claims that found the port taken (summed over allocations) */
	EV_DROP_NO_PORT,      /* dropped: no free port within the probes */
	EV_DROP_NO_ADDR,      /* dropped: masquerade decided but the uplink has no address */
	EV_DROP_REWRITE,      /* dropped: a rewrite helper failed midway */
	EV_HOST_FLOW,         /* host flows recorded (source port inside the NAT range) */
	EV_HOST_REMAP,        /* host flows whose port a pod mapping held: remapped */
	EV_INBOUND_FLOW,      /* inbound flows recorded */
	EV_NAT_RACE,          /* another CPU created the same mapping first: theirs was used */
	EV_REPAIR,            /* a flow's missing half (evicted) re-created from the other */
	EV_REALLOC,           /* a flow's port was taken over after eviction: new port allocated */
	EV_ICMP_ERROR,        /* ICMP errors translated */
	EV_FRAG_MISS,         /* later fragment that needed its first fragment's flow and found no room to wait
			       * for it (bpf/frag.h): untranslatable */
	EV_REOPEN,            /* TCP mapping reused by a new connection of its tuple (closed, or resynced) */
	EV_DROP_UNTRANSLATABLE, /* dropped: a pod's packet to a masqueraded destination that the NAT
				 * cannot translate (masq.c: untranslatable) */
	EV_CONFIRMED,         /* flows that proved two-way, moved to the table that never evicts */
	EV_CONFIRM_FULL,      /* flows that proved two-way but found that table full: left evictable */
	EV_TCP_OUT_OF_WINDOW, /* TCP FIN or RST outside what the receiver would accept: ignored */
	EV_KEEP_RETURN,       /* pod flows left alone by the policy: their verdict kept */
	EV_INBOUND_NOT_LOCAL, /* inbound openers toward an address not behind this node by its routes: held
			       * aside until a reply shows the node translated it (inbound_v4/v6) */
	EV_ORPHAN,            /* reply halves whose flow took another mapping: removed, port freed */
	EV_MAX,
};
