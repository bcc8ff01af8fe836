/* Maps of the SNAT engine. Sizes marked "load time" are placeholders: the Go loader sets them
 * (LoadOptions) before the maps are created. All maps are BTF-defined, so bpftool prints their
 * keys and values by field. */
#pragma once

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "types.h"

/* Which layout these maps are (entry 0; see struct layout). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct layout);
} layout SEC(".maps");

/* Policy: masqueradeCIDRs (rule 1 entries). */
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 1); /* load time */
	__type(key, struct lpm4_key);
	__type(value, struct lpm4_val);
} masq_v4 SEC(".maps");

/* Policy: link-local and nonMasqueradeCIDRs (rule 2 and 3 entries). */
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 1); /* load time */
	__type(key, struct lpm4_key);
	__type(value, struct lpm4_val);
} nomasq_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 1); /* load time */
	__type(key, struct lpm6_key);
	__type(value, struct lpm6_val);
} masq_v6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 1); /* load time */
	__type(key, struct lpm6_key);
	__type(value, struct lpm6_val);
} nomasq_v6 SEC(".maps");

/* Source rules (types.h: src_val): the source tries, the rule tries that hold every rule's
 * masquerade and non-masquerade lists under its id, and each rule's settings. New maps, so that
 * no pinned layout changes: an agent before them never reads them. */
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 1); /* load time */
	__type(key, struct lpm4_key);
	__type(value, struct src_val);
} src_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 1); /* load time */
	__type(key, struct lpm6_key);
	__type(value, struct src_val);
} src_v6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 1); /* load time */
	__type(key, struct rlpm4_key);
	__type(value, struct lpm4_val);
} rmasq_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 1); /* load time */
	__type(key, struct rlpm4_key);
	__type(value, struct lpm4_val);
} rnomasq_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 1); /* load time */
	__type(key, struct rlpm6_key);
	__type(value, struct lpm6_val);
} rmasq_v6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 1); /* load time */
	__type(key, struct rlpm6_key);
	__type(value, struct lpm6_val);
} rnomasq_v6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_SOURCE_IDS);
	__type(key, __u32);
	__type(value, struct src_rule);
} src_cfg SEC(".maps");

/* Policy: rule 4 and the NAT settings, in entry 0. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct nat_config);
} nat_config SEC(".maps");

/* The NAT port ranges laid out flat: entry i is the i-th port (host order) of the ranges, for
 * i < nat_config.nports. A port is then one lookup away, whatever the number of ranges. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, NAT_PORTS_MAX);
	__type(key, __u32);
	__type(value, __u16);
} nat_ports SEC(".maps");

/* Ports outside the NAT ranges that mappings still hold: those of an earlier --to-ports, kept by
 * its flows until they end, as conntrack keeps a binding. A bitmap (port p is bit p % 64 of entry
 * p / 64) that only userspace writes: replies to these ports are looked up and host flows on them
 * recorded (port_mapped), but no new mapping gets one (nat_ports). A new map, so that no pinned
 * layout changes. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, NAT_PORTS_MAX / 64);
	__type(key, __u32);
	__type(value, __u64);
} held_ports SEC(".maps");

/* SNAT addresses by uplink ifindex. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 64);
	__type(key, __u32);
	__type(value, struct uplink);
} uplink_snat SEC(".maps");

/* The MAC address of each uplink (by ifindex), which the node's IP stack writes as the source of
 * every frame it sends or forwards there: how egress tells them from frames bridged onto the
 * uplink (bpf/scope.h). A new map beside uplink_snat, so that no pinned layout changes. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 64);
	__type(key, __u32);
	__type(value, struct uplink_mac);
} uplink_macs SEC(".maps");

#include "rules.h"

/* The source rule (its id in src_cfg) whose list holds each counter slot's rule; 0: the global
 * lists. Userspace bookkeeping beside rule_slots (a new map, so that no layout changes). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1); /* load time */
	__type(key, __u32);
	__type(value, __u32);
} slot_source SEC(".maps");

/* The NAT tables (bpf/flow.h has the design). Confirmed flows, which nothing evicts: */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1); /* load time */
	__type(key, struct nat4_key);
	__type(value, struct nat_entry);
} nat_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1); /* load time */
	__type(key, struct nat6_key);
	__type(value, struct nat_entry);
} nat_v6 SEC(".maps");

/* Flows not yet confirmed, least recently used evicted first. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1); /* load time */
	__type(key, struct nat4_key);
	__type(value, struct nat_entry);
} nat_new_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1); /* load time */
	__type(key, struct nat6_key);
	__type(value, struct nat_entry);
} nat_new_v6 SEC(".maps");

/* Pod flows that the policy left alone, with the verdict they keep (egress keys). */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1); /* load time */
	__type(key, struct nat4_key);
	__type(value, struct keep_entry);
} keep_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1); /* load time */
	__type(key, struct nat6_key);
	__type(value, struct keep_entry);
} keep_v6 SEC(".maps");

/* Where each remote endpoint's port sequence stands (nat_alloc), by a hash of the endpoint. */
#define PORT_TURNS 4096

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, PORT_TURNS);
	__type(key, __u32);
	__type(value, __u32);
} port_turns SEC(".maps");

/* How many probes new mappings took: per-CPU counts of the allocations that needed at most 1, 2,
 * 4, ... NAT_PROBES probes (bucket i: up to 2^i), and in the last slot the probes they summed to. */
#define PORT_ATTEMPT_BUCKETS 8
#define PORT_ATTEMPT_SUM PORT_ATTEMPT_BUCKETS

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, PORT_ATTEMPT_BUCKETS + 1);
	__type(key, __u32);
	__type(value, __u64);
} port_attempts SEC(".maps");

/* Ports of the first fragment of datagrams, for their later fragments. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1); /* load time */
	__type(key, struct frag4_key);
	__type(value, struct frag_ports);
} frag_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1); /* load time */
	__type(key, struct frag6_key);
	__type(value, struct frag_ports);
} frag_v6 SEC(".maps");

/* Later fragments held until their datagram's first fragment comes (bpf/frag.h). Allocated as
 * they are held, so that the room costs nothing unused; the userspace sweep removes what waited
 * longer than the kernel's reassembly would. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 1); /* load time */
	__type(key, struct frag4_held_key);
	__type(value, struct frag_held);
} frag_held_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 1); /* load time */
	__type(key, struct frag6_held_key);
	__type(value, struct frag_held);
} frag_held_v6 SEC(".maps");

/* An empty held fragment, which a new one is made from (its bytes are written in place): it
 * holds nothing, so it is not pinned and no layout has it. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct frag_held);
} frag_blank SEC(".maps");

/* Connections opened from outside toward an address that the node neither owns nor routes behind
 * it, held by the key of their replies as they leave (egress), until one leaves: then the node's
 * stack translated the destination to an address behind it (kube-proxy's DNAT of a load-balancer
 * or external IP to a pod), and the flow becomes an inbound one. The value is the opener's half
 * as ingress would have recorded it. Least recently used first out. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1); /* load time */
	__type(key, struct nat4_key);
	__type(value, struct nat_entry);
} inbound_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1); /* load time */
	__type(key, struct nat6_key);
	__type(value, struct nat_entry);
} inbound_v6 SEC(".maps");

/* Drop and event counters by reason (enum event). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, EV_MAX);
	__type(key, enum event);
	__type(value, __u64);
} event_stats SEC(".maps");

/* NAT entries the userspace sweep removed, by IP protocol number. Only userspace writes it;
 * it lives here so that the totals survive an agent restart and bpftool shows them. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 256);
	__type(key, __u32);
	__type(value, __u64);
} sweep_stats SEC(".maps");

/* When our programs last ran on each hook: a bpf_ktime_get_ns stamp per device slot and
 * direction (hook_slot), refreshed at most every HOOK_REFRESH_NS so that its cache line stays
 * quiet. Userspace compares it with the device's own packet counters: a device that moves
 * packets while the stamp stands still has a program ahead of ours that ends the chain. Devices
 * whose ifindexes are equal modulo HOOK_SLOTS share a slot. */
#define HOOK_SLOTS 256
#define HOOK_REFRESH_NS 100000000ULL

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 2 * HOOK_SLOTS);
	__type(key, __u32);
	__type(value, __u64);
} hook_seen SEC(".maps");

static __always_inline __u32 hook_slot(__u32 ifindex, __u32 dir)
{
	return (ifindex & (HOOK_SLOTS - 1)) << 1 | dir;
}

static __always_inline void event_add(__u32 ev, __u64 n)
{
	__u64 *c = bpf_map_lookup_elem(&event_stats, &ev);

	if (c)
		*c += n;
}
