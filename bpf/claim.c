//go:build ignore

/* claim_slots: the counter slots a policy sync gives to new rules, each zeroed on every CPU and
 * given its owner in rule_slots, in the kernel. From userspace that is a batch update of a
 * per-CPU map, whose values cilium/ebpf converts one CPU at a time (for 100k slots on 2 CPUs
 * 25 ms, growing with the CPUs), and one of rule_slots: most of the time a swap of 100k CIDRs
 * took before its first trie write. A BPF_PROG_TYPE_SYSCALL program (BPF_PROG_TEST_RUN) does it
 * for a batch of CLAIM_BATCH slots that userspace wrote into claims in one update. Kernels
 * without it (bpf_map_lookup_percpu_elem: 5.19) get the batch updates (pkg/bpf: claimer). */

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "types.h"
#include "rules.h"

#define CLAIM_BATCH 2048

/* A slot to claim and the rule it goes to. */
struct slot_claim {
	__u32 slot;
	__u32 pad;
	struct rule_slot owner;
};

struct claim_batch {
	struct slot_claim items[CLAIM_BATCH];
};

/* The batch of the next run (entry 0); this program's alone, never pinned. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct claim_batch);
} claims SEC(".maps");

/* The context of a run: how many items of the batch to claim, and over how many CPUs. */
struct claim_args {
	__u32 n;
	__u32 cpus;
};

struct claim_state {
	struct claim_batch *batch;
	__u32 cpus;
	__u32 slot;
	__u32 failed; /* slots out of the maps' range */
};

static long zero_cpu(__u32 cpu, struct claim_state *st)
{
	struct rule_stats *s = bpf_map_lookup_percpu_elem(&rule_stats, &st->slot, cpu);

	if (s) {
		s->packets = 0;
		s->bytes = 0;
	}
	return 0;
}

static long claim_one(__u32 i, struct claim_state *st)
{
	struct slot_claim *c;

	if (i >= CLAIM_BATCH)
		return 1;
	c = &st->batch->items[i];
	st->slot = c->slot;
	if (bpf_map_update_elem(&rule_slots, &c->slot, &c->owner, BPF_ANY)) {
		st->failed++;
		return 0;
	}
	bpf_loop(st->cpus, zero_cpu, st, 0);
	return 0;
}

/* Returns how many slots of the batch it could not claim (out of range), or a negative errno. */
SEC("syscall")
int claim_slots(struct claim_args *args)
{
	__u32 zero = 0;
	struct claim_state st = {.cpus = args->cpus};
	long done;

	st.batch = bpf_map_lookup_elem(&claims, &zero);
	if (!st.batch)
		return -1;
	done = bpf_loop(args->n, claim_one, &st, 0);
	if (done < 0)
		return done;
	return st.failed + (args->n - done);
}

char __license[] SEC("license") = "Dual BSD/GPL";
