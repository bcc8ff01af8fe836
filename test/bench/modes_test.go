package bench

import (
	"context"
	"net"
	"net/netip"
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/tc"
	"github.com/ip-masq-agent/ip-masq-agent/test/e2e"
)

// allModes are the ways of running the node that the benchmarks compare: the limit (no agent),
// then each backend with its default flags and with --random-fully=false (the choice an informed
// user of the upstream agent makes). Only the default-flag modes are measured for apply latency
// and memory, which the flag does not change. A backend is one line here.
func allModes() []Mode {
	bpf := e2e.BPFBackend(tc.ModeTCX)
	ipt := e2e.IptablesBackend(iptables.ModeNFT)
	nft := e2e.NftablesBackend()
	return []Mode{
		{Name: "none"},
		{Name: "bpf", Backend: &bpf},
		{Name: "bpf-norandom", Backend: &bpf, Flags: noRandomFully},
		{Name: "iptables", Backend: &ipt},
		{Name: "iptables-norandom", Backend: &ipt, Flags: noRandomFully},
		{Name: "nftables", Backend: &nft},
		{Name: "nftables-norandom", Backend: &nft, Flags: noRandomFully},
	}
}

// noRandomFully are the flags of a mode's --random-fully=false variant.
var noRandomFully = []string{"--random-fully=false"}

// natFiller returns, for a mode with a NAT table, a function that fills it with flows and
// returns how many entries the agent reports; nil for modes without one.
func natFiller(m Mode) func(ctx context.Context, b *testing.B, e *e2e.Env) int {
	if m.Backend == nil || !m.Backend.NAT {
		return nil
	}
	return fillNAT
}

// natFlows is how many masqueraded flows fillNAT opens: two NAT entries each.
const natFlows = 50_000

var natEntriesRE = regexp.MustCompile(`(?m)^ip_masq_agent_nat_entries\{[^}]*\} (\d+)`)

// fillNAT sends one UDP datagram to each of natFlows destination ports of the target from one
// pod socket: every datagram opens a masqueraded flow. It returns the NAT entries the agent's
// metrics report once they are all in.
func fillNAT(ctx context.Context, b *testing.B, e *e2e.Env) int {
	b.Helper()
	err := testutil.Do(e.Pod, func() error {
		conn, err := net.ListenUDP("udp", nil)
		if err != nil {
			return err
		}
		defer conn.Close()
		for i := range natFlows {
			dst := netip.AddrPortFrom(target, uint16(10000+i))
			if _, err := conn.WriteToUDPAddrPort([]byte("x"), dst); err != nil {
				return err
			}
			if i%1000 == 999 {
				time.Sleep(time.Millisecond) // stay within the veth queues
			}
		}
		return nil
	})
	if err != nil {
		b.Fatalf("fill the NAT table: %v", err)
	}
	entries := 0
	_ = testutil.Poll(30*time.Second, 200*time.Millisecond, func() error {
		_, body, err := e.Agent.Get(ctx, "/metrics")
		if err != nil {
			b.Fatal(err)
		}
		entries = 0
		for _, m := range natEntriesRE.FindAllStringSubmatch(body, -1) {
			n, _ := strconv.Atoi(m[1])
			entries += n
		}
		if entries < 2*natFlows*9/10 {
			return testutil.NotYet("%d NAT entries", entries)
		}
		return nil
	}) // the caller reports how many there were
	// Past a sweep of the full table (every 10 s), whose walk is what would grow the heap.
	time.Sleep(12 * time.Second)
	return entries
}
