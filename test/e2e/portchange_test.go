package e2e

import (
	"context"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// TestToPortsChangeKeepsFlows: a TCP connection and a UDP flow, IPv4 and IPv6, open across a
// --to-ports change (the agent restarted with another range, as a rollout of a changed
// DaemonSet does) keep working from the ports they had, on every backend, as conntrack keeps
// every binding until its flow ends; new flows get ports of the new range. The external host
// has no route back to the pod, so every answer proves a translation. On BPF the old ports stay
// held through sweeps (every 200 ms here) while the flows live.
func TestToPortsChangeKeepsFlows(t *testing.T) {
	oldRange := policy.PortRange{First: 40000, Last: 40999}
	newRange := policy.PortRange{First: 50000, Last: 50999}
	flags := []string{"--enable-ipv6", "--nat-sweep-interval=200ms", "--to-ports=" + oldRange.String()}
	eachBackend(t, backends(), flags, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		ag := env.StartReadyNoFile(ctx, t, b)
		StartLineEcho(t, env.Ext, []netip.Addr{public4, public6})
		env.CutReturnRoutes(ctx, t)
		inRange := func(r policy.PortRange, src netip.AddrPort) bool {
			return src.Port() >= r.First && src.Port() <= r.Last
		}
		var held []*heldFlow
		for _, dst := range []netip.Addr{public4, public6} {
			f := holdFlows(ctx, t, env, dst)
			if !inRange(oldRange, f.tcpSrc) || !inRange(oldRange, f.udpSrc) {
				t.Fatalf("flows to %s seen from %s (tcp) and %s (udp), want ports of %s", dst, f.tcpSrc, f.udpSrc, oldRange)
			}
			held = append(held, f)
		}

		if err := ag.Stop(ctx); err != nil {
			t.Fatalf("stop the agent: %v", err)
		}
		env.Flags = append(slices.Clone(env.Flags[:len(env.Flags)-1]), "--to-ports="+newRange.String())
		ag = env.StartReadyNoFile(ctx, t, b)
		for _, f := range held {
			f.check(t, "after the --to-ports change")
		}
		for _, dst := range []netip.Addr{public4, public6} {
			f := holdFlows(ctx, t, env, dst)
			if !inRange(newRange, f.tcpSrc) || !inRange(newRange, f.udpSrc) {
				t.Errorf("new flows to %s seen from %s (tcp) and %s (udp), want ports of %s", dst, f.tcpSrc, f.udpSrc, newRange)
			}
		}
		if b.NAT {
			if err := ag.WaitLog(ctx, 1, "ports of earlier --to-ports ranges stay held for their flows"); err != nil {
				t.Fatalf("%v\n%s", err, ag.Logs())
			}
		}
		time.Sleep(time.Second) // sweeps, each trimming the held ports to those the flows hold
		for _, f := range held {
			f.check(t, "a second after the change")
		}
	})
}
