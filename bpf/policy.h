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

/* source_rule is the id of the source rule that decides the flows of saddr (the first rule that
 * holds it: the longest match of the source trie), or 0: the global lists. */
static __always_inline __u32 source_rule(const int v6, const __be32 *saddr)
{
	struct src_val *v;

	if (v6) {
		struct lpm6_key k = {.prefixlen = 128};

		__builtin_memcpy(k.addr, saddr, 16);
		v = bpf_map_lookup_elem(&src_v6, &k);
	} else {
		struct lpm4_key k = {.prefixlen = 32};

		__builtin_memcpy(k.addr, saddr, 4);
		v = bpf_map_lookup_elem(&src_v4, &k);
	}
	return v ? v->rule : 0;
}

/* rule_cfg is the family settings of source rule `rule` (src_cfg), or the global ones (rule 0). An
 * id past the array is the global lists' too: a sync writes a rule's settings before any source
 * names it. */
static __always_inline const struct family_cfg *rule_cfg(const struct nat_config *cfg, const int v6, __u32 rule)
{
	const struct src_rule *r;

	if (!rule)
		return family_cfg(cfg, v6);
	r = bpf_map_lookup_elem(&src_cfg, &rule);
	if (!r)
		return family_cfg(cfg, v6);
	return v6 ? &r->v6 : &r->v4;
}

/* lookup_rule looks daddr up in the lists of rule: the global tries (rule 0) or the rule tries
 * under its id; the masquerade trie first. */
static __always_inline const void *lookup_rule(const int v6, __u32 rule, const __be32 *daddr)
{
	const void *v;

	if (v6) {
		if (!rule) {
			struct lpm6_key k = {.prefixlen = 128};

			__builtin_memcpy(k.addr, daddr, 16);
			v = bpf_map_lookup_elem(&masq_v6, &k);
			return v ? v : bpf_map_lookup_elem(&nomasq_v6, &k);
		} else {
			struct rlpm6_key k = {.prefixlen = 32 + 128, .rule = rule};

			__builtin_memcpy(k.addr, daddr, 16);
			v = bpf_map_lookup_elem(&rmasq_v6, &k);
			return v ? v : bpf_map_lookup_elem(&rnomasq_v6, &k);
		}
	}
	if (!rule) {
		struct lpm4_key k = {.prefixlen = 32};

		__builtin_memcpy(k.addr, daddr, 4);
		v = bpf_map_lookup_elem(&masq_v4, &k);
		return v ? v : bpf_map_lookup_elem(&nomasq_v4, &k);
	} else {
		struct rlpm4_key k = {.prefixlen = 32 + 32, .rule = rule};

		__builtin_memcpy(k.addr, daddr, 4);
		v = bpf_map_lookup_elem(&rmasq_v4, &k);
		return v ? v : bpf_map_lookup_elem(&rnomasq_v4, &k);
	}
}

/* classify_snat returns the action for a new flow from saddr to daddr, as DecideFrom gives it: the
 * source rule that holds saddr (source_rule) decides by its lists, a source none holds by the
 * global ones; within them, the trie entry that matches (or the outbound rule). It sets *slot to
 * the deciding rule's counter slot (NO_SLOT at the end of the chain) and, where snat is given,
 * *snat to the masquerade address the entry holds, else the source rule's masqueradeAddress (0:
 * none: the family's or the uplink's, uplink_snat_of). The address comes with the lookups that
 * decide. A flow of a known mapping never gets here: one lookup of the source per new flow. */
static __always_inline __u8 classify_snat(const int v6, const __be32 *saddr, const __be32 *daddr,
					  const struct nat_config *cfg, __u32 *slot, const __be32 **snat)
{
	__u32 rule = source_rule(v6, saddr);
	const struct family_cfg *fc = rule_cfg(cfg, v6, rule);
	/* lpm4_val and lpm6_val share their first fields: the slot, the action, then snat. */
	const struct lpm6_val *v = lookup_rule(v6, rule, daddr);

	if (snat)
		*snat = 0;
	if (v) {
		*slot = v->slot;
		if (snat)
			*snat = snat_of(v6, v->snat);
		if (snat && !*snat && rule)
			*snat = snat_of(v6, fc->snat);
		return v->action;
	}
	*slot = fc->out_slot;
	if (snat && rule)
		*snat = snat_of(v6, fc->snat);
	return fc->outbound;
}

/* classify is classify_snat without the address. */
static __always_inline __u8 classify(const int v6, const __be32 *saddr, const __be32 *daddr,
				     const struct nat_config *cfg, __u32 *slot)
{
	return classify_snat(v6, saddr, daddr, cfg, slot, 0);
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
