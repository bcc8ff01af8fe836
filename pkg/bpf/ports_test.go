package bpf

import (
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// TestPortChoiceTowardOneEndpoint: with --random-fully, the ports of successive flows toward one
// endpoint tell nothing of each other (as the kernel's, each allocation draws afresh); without it,
// flows whose own port lies outside the range take the endpoint's next ports in turn, so that
// reuse toward it is spread over time.
func TestPortChoiceTowardOneEndpoint(t *testing.T) {
	const flows = 64
	for _, tc := range []struct {
		name        string
		randomFully bool
		// in turn: how many of the flows' successive ports must follow each other in the range
		// (at least, without random-fully; at most, with it).
		inTurn int
	}{
		{"random-fully", true, 2},
		{"norandom", false, flows - 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, policy.Compile(config.Default(config.Options{}), policy.Options{RandomFully: tc.randomFully}), LoadOptions{})
			r := policy.DefaultPortRange
			n := int(r.Last-r.First) + 1
			dst := ap(remote4, 443)
			prev, inTurn := -1, 0
			for i := range flows {
				// Pod ports below the range: none is kept as it is.
				nat := tupleOf(t, h.mustPass(h.dp.Egress(), tcpPacket(ap(pod4(1), uint16(2000+i)), dst, tcpSYN, nil))).src
				idx := int(nat.Port()) - int(r.First)
				if idx < 0 || idx >= n {
					t.Fatalf("flow %d got port %d, outside %d-%d", i, nat.Port(), r.First, r.Last)
				}
				if prev >= 0 && idx == (prev+1)%n {
					inTurn++
				}
				prev = idx
			}
			t.Logf("%d of %d successive ports in turn", inTurn, flows-1)
			if tc.randomFully && inTurn > tc.inTurn {
				t.Fatalf("with random-fully, %d of %d successive ports toward one endpoint follow each other", inTurn, flows-1)
			}
			if !tc.randomFully && inTurn < tc.inTurn {
				t.Fatalf("without random-fully, only %d of %d successive ports toward one endpoint follow each other", inTurn, flows-1)
			}
		})
	}
}
