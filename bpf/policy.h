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

/* snat_of is the masquerade address an address field holds (a trie value's: its rule's own; a
 * family_cfg's: the family's masqueradeAddress), IPv4 in the first word, or 0 when it holds none
 * (all zero). */
static __always_inline const __be32 *snat_of(const int v6, const __u8 *snat)
{
	const __be32 *w = (const __be32 *)snat;

	if (v6 ? (w[0] | w[1] | w[2] | w[3]) : w[0])
		return w;
	return 0;
}

/* classify_snat returns the action for a new flow to daddr, as the trie entry that matches holds
 * it (or the outbound rule), and sets *slot to the deciding rule's counter slot (NO_SLOT at the
 * end of the chain) and, where snat is given, *snat to the masquerade address the entry holds (0:
 * none: the family's or the uplink's, uplink_snat_of). The address comes with the lookup that
 * decides: no other map is read. */
static __always_inline __u8 classify_snat(const int v6, const __be32 *daddr, const struct family_cfg *fc,
					  __u32 *slot, const __be32 **snat)
{
	if (snat)
		*snat = 0;
	if (v6) {
		struct lpm6_key k = {.prefixlen = 128};
		struct lpm6_val *v;

		__builtin_memcpy(k.addr, daddr, 16);
		v = bpf_map_lookup_elem(&masq_v6, &k);
		if (!v)
			v = bpf_map_lookup_elem(&nomasq_v6, &k);
		if (v) {
			*slot = v->slot;
			if (snat)
				*snat = snat_of(1, v->snat);
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
			if (snat)
				*snat = snat_of(0, v->snat);
			return v->action;
		}
	}
	*slot = fc->out_slot;
	return fc->outbound;
}

/* classify is classify_snat without the address. */
static __always_inline __u8 classify(const int v6, const __be32 *daddr, const struct family_cfg *fc,
				     __u32 *slot)
{
	return classify_snat(v6, daddr, fc, slot, 0);
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
