/* The rules' counter slots: their counters and owners, which the SNAT engine (masq.c) counts into
 * and the slot claims (claim.c) reset. */
#pragma once

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "types.h"

/* Per-rule hit counters, indexed by counter slot. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1); /* load time */
	__type(key, __u32);
	__type(value, struct rule_stats);
} rule_stats SEC(".maps");

/* Which rule each counter slot belongs to (userspace bookkeeping, never read by masq.c). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1); /* load time */
	__type(key, __u32);
	__type(value, struct rule_slot);
} rule_slots SEC(".maps");
