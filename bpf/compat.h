/* What the kernels of the matrix (5.10 to the newest: test/kernels) do differently, written once.
 *
 * Bounds: newer verifiers deduce more from a comparison than older ones: the same program that
 * loads on 6.18 is refused by 5.10, 6.1 or 6.12 when a bound reaches the helper call or the
 * pointer arithmetic that needs it only through a deduction those lack. size_in and masked
 * state a bound in the form the oldest verifiers read, behind a barrier so that clang cannot
 * fold it back into one they do not (it sees no value through the barrier, so it keeps the
 * test).
 *
 * Results: map_update. */
#ifndef IPMASQ_COMPAT_H
#define IPMASQ_COMPAT_H

#include <linux/types.h>
#include <bpf/bpf_helpers.h> /* barrier_var: hides a value from clang, not from the verifier */

/* size_in tells whether len, a helper's size argument (a __u32 variable), lies in [1, max], and
 * leaves len itself bounded so for any verifier. Written as `len == 0 || len > max`, clang
 * compares a copy (len - 1), and verifiers before 6.8 raise no lower bound from len != 0: the
 * helper then sees a size that may be zero. Here len is compared twice, the second time signed,
 * from which every verifier derives len >= 1. */
#define size_in(len, max)                                                                          \
	({                                                                                         \
		int ok_ = 0;                                                                       \
		if ((len) <= (max)) {                                                              \
			barrier_var(len);                                                          \
			ok_ = (__s32)(len) > 0;                                                    \
		}                                                                                  \
		ok_;                                                                               \
	})

/* masked is v & mask where the caller has already bounded v within mask, which changes nothing:
 * for a verifier that lost the bound on the way (see pull_off). */
static __always_inline __u32 masked(__u32 v, __u32 mask)
{
	barrier_var(v);
	return v & mask;
}

/* map_update is bpf_map_update_elem's result as the int the map's own code returns. Before 6.4
 * the verifier replaces the helper by a direct call of that code, whose int result leaves the
 * upper half of the register zero: -EEXIST comes back as 0xffffffef, which no 64-bit test of a
 * negative value matches. */
#define map_update(map, key, value, flags) ((int)bpf_map_update_elem(map, key, value, flags))

#endif
