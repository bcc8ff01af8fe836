package bench

import (
	"context"
	"fmt"
	"net"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/test/bench/benchdata"
	"github.com/ip-masq-agent/ip-masq-agent/test/e2e"
)

// measurePacketCost runs mode m (a BPF one) once more on topology e with the kernel's BPF
// statistics on, and reads what its two programs cost per run during the short-connection load
// and during bulk. Statistics stay off during the runs the rates come from: they add two clock
// reads to every program run on the machine.
func measurePacketCost(ctx context.Context, b *testing.B, bins binaries, e *e2e.Env, m Mode, n int, prepared map[string]bool) []benchdata.PacketCost {
	b.Helper()
	clearTimeWait(ctx, b, e.Ext)
	startMode(ctx, b, e, m, prepared)
	defer stopMode(ctx, b, e, m)
	progs := uplinkPrograms(b, e)
	defer func() {
		for _, p := range progs {
			p.Close()
		}
	}()
	stats, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
	if err != nil {
		b.Fatalf("enable BPF run-time statistics: %v", err)
	}
	defer stats.Close()
	var out []benchdata.PacketCost
	for _, load := range []struct {
		name string
		run  func()
	}{
		{"connections", func() { connRate(ctx, b, bins, e) }},
		{"bulk", func() { bulk(ctx, b, e) }},
	} {
		before := programStats(b, progs)
		load.run()
		after := programStats(b, progs)
		for _, dir := range []string{"egress", "ingress"} {
			runs := after[dir].RunCount - before[dir].RunCount
			c := benchdata.PacketCost{Mode: m.Name, CIDRs: n, Load: load.name, Dir: dir, Runs: runs}
			if runs > 0 {
				c.NsPerRun = float64(after[dir].Runtime-before[dir].Runtime) / float64(runs)
			}
			b.Logf("%s cidrs=%d %s: tc_%s %.0f ns per run over %d runs", m.Name, n, load.name, dir, c.NsPerRun, runs)
			out = append(out, c)
		}
	}
	return out
}

// uplinkPrograms opens our two programs on the node's uplink, as tcx reports them, by direction.
func uplinkPrograms(b *testing.B, e *e2e.Env) map[string]*ebpf.Program {
	b.Helper()
	progs := map[string]*ebpf.Program{}
	err := testutil.Do(e.Node, func() error {
		ifc, err := net.InterfaceByName(e2e.Uplink)
		if err != nil {
			return err
		}
		for dir, typ := range map[string]ebpf.AttachType{"egress": ebpf.AttachTCXEgress, "ingress": ebpf.AttachTCXIngress} {
			res, err := link.QueryPrograms(link.QueryOptions{Target: ifc.Index, Attach: typ})
			if err != nil {
				return fmt.Errorf("query tcx %s: %w", dir, err)
			}
			for _, a := range res.Programs {
				p, err := ebpf.NewProgramFromID(a.ID)
				if err != nil {
					return err
				}
				info, err := p.Info()
				if err != nil {
					p.Close()
					return err
				}
				if info.Name != "tc_"+dir {
					p.Close()
					continue
				}
				progs[dir] = p
			}
			if progs[dir] == nil {
				return fmt.Errorf("no tc_%s on %s's tcx %s hook", dir, e2e.Uplink, dir)
			}
		}
		return nil
	})
	if err != nil {
		for _, p := range progs {
			p.Close()
		}
		b.Fatalf("find the programs on the uplink: %v", err)
	}
	return progs
}

func programStats(b *testing.B, progs map[string]*ebpf.Program) map[string]ebpf.ProgramStats {
	b.Helper()
	out := map[string]ebpf.ProgramStats{}
	for dir, p := range progs {
		s, err := p.Stats()
		if err != nil {
			b.Fatalf("read tc_%s statistics: %v", dir, err)
		}
		out[dir] = *s
	}
	return out
}
