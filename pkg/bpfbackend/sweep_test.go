package bpfbackend

import (
	"context"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf"
)

// TestSweepLoop: the backend's sweep removes idle flows on its own, and the NAT metrics count
// them by protocol. The backend is assembled by hand (New would follow the host's uplinks); the
// flows are made with BPF_PROG_TEST_RUN, which sends nothing.
func TestSweepLoop(t *testing.T) {
	bpffs := testutil.MountBPFFS(t)
	dp := loadPinned(t, bpffs, compile(t, "", false))
	node := netip.MustParseAddr("192.0.2.1")
	if _, err := dp.SetUplink(1, bpf.Uplink{IPv4: node}); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		src := netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 1, 0, byte(10 + i)}), 1000)
		run(t, dp.Egress(), udp(t, src, netip.MustParseAddrPort("198.51.100.7:53")))
	}
	b := &Backend{log: slog.New(slog.DiscardHandler), opts: Options{SweepInterval: 20 * time.Millisecond,
		Timeouts: bpf.Timeouts{TCPEstablished: time.Hour, TCPOpening: time.Hour, TCPClosing: time.Hour,
			UDP: 200 * time.Millisecond, ICMP: time.Hour, Other: time.Hour}}}
	b.dp.Store(dp)
	st, err := b.NATStats(context.Background())
	if err != nil || len(st.Entries) != 1 || st.Entries[0].Entries != 6 || st.Swept["udp"] != 0 {
		t.Fatalf("before the sweep: %+v %v", st, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		b.sweepLoop(ctx)
	}()
	defer func() {
		cancel()
		<-done
	}()
	if err := testutil.Poll(5*time.Second, 20*time.Millisecond, func() error {
		st, err := b.NATStats(context.Background())
		if err == nil && (len(st.Entries) > 0 || st.Swept["udp"] != 6) {
			return testutil.NotYet("the sweep to remove the idle flows: %+v", st)
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
}

// TestSweepFollowsNodeTimeouts: without --nat-timeouts the sweep takes the node's conntrack
// sysctls, read at every sweep: UDP flows that the node's 3600 s keep are swept once the
// sysctl says 1 s, and the agent logs the timeout in force and where it comes from.
func TestSweepFollowsNodeTimeouts(t *testing.T) {
	bpffs := testutil.MountBPFFS(t)
	dp := loadPinned(t, bpffs, compile(t, "", false))
	if _, err := dp.SetUplink(1, bpf.Uplink{IPv4: netip.MustParseAddr("192.0.2.1")}); err != nil {
		t.Fatal(err)
	}
	sysctls := t.TempDir()
	udpTimeout := func(s string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(sysctls, "nf_conntrack_udp_timeout_stream"), []byte(s+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	udpTimeout("3600")
	for i := range 3 {
		src := netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 1, 0, byte(10 + i)}), 1000)
		run(t, dp.Egress(), udp(t, src, netip.MustParseAddrPort("198.51.100.7:53")))
	}
	var logs testutil.Buffer
	b := &Backend{log: slog.New(slog.NewTextHandler(&logs, nil)), opts: Options{SweepInterval: 20 * time.Millisecond, ConntrackDir: sysctls}}
	b.dp.Store(dp)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		b.sweepLoop(ctx)
	}()
	defer func() {
		cancel()
		<-done
	}()
	entries := func() int {
		t.Helper()
		st, err := b.NATStats(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, e := range st.Entries {
			n += int(e.Entries)
		}
		return n
	}
	time.Sleep(300 * time.Millisecond) // sweeps
	if n := entries(); n != 6 {
		t.Fatalf("%d entries left while the node keeps UDP flows an hour, want the 6 of the flows", n)
	}
	udpTimeout("1")
	deadline := time.Now().Add(5 * time.Second)
	for entries() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the flows outlived the node's UDP timeout of 1 s:\n%s", logs.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, want := range []string{`udp="1h0m0s (the node's conntrack sysctl)"`, `udp="1s (the node's conntrack sysctl)"`,
		`tcp-established="120h0m0s (conntrack's default)"`} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("the logs lack %s:\n%s", want, logs.String())
		}
	}
}
