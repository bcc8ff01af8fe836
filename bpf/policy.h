/* Policy lookup: the ordered rule list of the chain, as two LPM tries and a fallback.
 *
 * Rule 1 entries (masqueradeCIDRs) precede every RETURN rule, so any match in the masquerade
 * trie decides; otherwise the first RETURN rule that matches decides (link-local and
 * nonMasqueradeCIDRs share one action, so the longest match among them gives the same
 * verdict as the first match); otherwise the outbound rule. Each trie value holds the verdict
 * (MASQUERADE in the masquerade tries, RETURN in the others) and the counter slot of the rule a
 * first-match chain counts for that longest match (computed in userspace). */
#pragma once

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "maps.h"

static __always_inline const struct family_cfg *family_cfg(const struct nat_config *cfg, const int v6)
{
	return v6 ? &cfg->v6 : &cfg->v4;
}

/* classify returns the action for a new flow to daddr, as the trie entry that matches holds it
 * (or the outbound rule), and sets *slot to the deciding rule's counter slot (NO_SLOT at the end
 * of the chain). */
static __always_inline __u8 classify(const int v6, const __be32 *daddr, const struct family_cfg *fc,
				     __u32 *slot)
{
	if (v6) {
		struct lpm6_key k = {.prefixlen = 128};
		struct lpm6_val *v;

		__builtin_memcpy(k.addr, daddr, 16);
		v = bpf_map_lookup_elem(&masq_v6, &k);
		if (!v)
			v = bpf_map_lookup_elem(&nomasq_v6, &k);
		if (v) {
			*slot = v->slot;
			return v->action;
		}
	} else {
		struct lpm4_key k = {.prefixlen = 32};
		struct lpm4_val *v;

		__builtin_memcpy(k.addr, daddr, 4);
		v = bpf_map_lookup_elem(&masq_v4, &k);
		if (!v)
			v = bpf_map_lookup_elem(&nomasq_v4, &k);
		if (v) {
			*slot = v->slot;
			return v->action;
		}
	}
	*slot = fc->out_slot;
	return fc->outbound;
}

/* count_rule adds a packet to a rule's per-CPU counters. */
static __always_inline void count_rule(__u32 slot, __u32 len)
{
	struct rule_stats *s;

	if (slot == NO_SLOT)
		return;
	s = bpf_map_lookup_elem(&rule_stats, &slot);
	if (s) {
		s->packets++;
		s->bytes += len;
	}
}
