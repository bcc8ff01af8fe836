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
	if err := testutil.Poll(5*time.Second, 20*time.Millisecond, func() error {
		if n := entries(); n != 0 {
			return testutil.NotYet("%d entries", n)
		}
		return nil
	}); err != nil {
		t.Fatalf("the flows outlived the node's UDP timeout of 1 s: %v\n%s", err, logs.String())
	}
	for _, want := range []string{`udp="1h0m0s (the node's conntrack sysctl)"`, `udp="1s (the node's conntrack sysctl)"`,
		`tcp-established="120h0m0s (conntrack's default)"`} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("the logs lack %s:\n%s", want, logs.String())
		}
	}
}

// TestSweepWalksWhenDue: the loop walks large tables (every table, here) when a flow can have
// expired, not every interval: with flows of an hour's timeout and ICMP's of 300 ms (the
// shortest, which a new flow could have), the 10 ms ticks hold a walk every 300 ms at most; and
// the metrics of a large table count the entries from the walk, not at each scrape.
func TestSweepWalksWhenDue(t *testing.T) {
	bpffs := testutil.MountBPFFS(t)
	dp := loadPinned(t, bpffs, compile(t, "", false))
	if _, err := dp.SetUplink(1, bpf.Uplink{IPv4: netip.MustParseAddr("192.0.2.1")}); err != nil {
		t.Fatal(err)
	}
	flow := func(i int) {
		src := netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 1, 0, byte(10 + i)}), 1000)
		run(t, dp.Egress(), udp(t, src, netip.MustParseAddrPort("198.51.100.7:53")))
	}
	flow(0)
	var logs testutil.Buffer
	b := &Backend{log: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
		sweepNow: make(chan struct{}, 1), largeTables: 1, // the census of tables of any size
		opts: Options{SweepInterval: 10 * time.Millisecond, Timeouts: bpf.Timeouts{TCPEstablished: time.Hour,
			TCPOpening: time.Hour, TCPClosing: time.Hour, UDP: time.Hour, ICMP: 300 * time.Millisecond, Other: time.Hour}}}
	b.dp.Store(dp)
	b.sweepSoon()
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
	walks := func() int { return strings.Count(logs.String(), `msg="NAT walk"`) }
	if err := testutil.Poll(5*time.Second, 5*time.Millisecond, func() error {
		if walks() == 0 {
			return testutil.NotYet("the first walk")
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	flow(1) // after the first walk: counted from the next
	entries := func() uint64 {
		st, err := b.NATStats(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		n := uint64(0)
		for _, e := range st.Entries {
			n += e.Entries
		}
		return n
	}
	if n, w := entries(), walks(); n != 2 && w == 1 {
		t.Errorf("the metrics count %d entries before the second walk, want the first walk's 2", n)
	}
	// Walks keep coming, when due: at most one per 300 ms (each paced over a few ticks), where the
	// ticks come every 10 ms.
	start := time.Now()
	if err := testutil.Poll(20*time.Second, 10*time.Millisecond, func() error {
		if w := walks(); w < 4 {
			return testutil.NotYet("4 walks, %d so far", w)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if w, most := walks(), int(time.Since(start)/(300*time.Millisecond))+2; w > most {
		t.Errorf("%d walks in %v of 10 ms ticks, want at most %d (one per 300 ms):\n%s", w, time.Since(start), most, logs.String())
	}
	if n := entries(); n != 4 {
		t.Errorf("the metrics count %d entries after later walks, want the 4 of both flows", n)
	}
	// Tables smaller than largeTables are counted at each scrape.
	flow(2)
	b.largeTables = 0
	if n := entries(); n != 6 {
		t.Errorf("the metrics count %d entries of a small table, want the 6 it holds", n)
	}
}

// TestNextWalk: small tables are walked every interval; large ones when a flow can expire (the
// walk's pace is its own), unless the last walk found a table under pressure or held fragments.
func TestNextWalk(t *testing.T) {
	start, mono := time.Unix(1000, 0), 500*time.Second
	for _, c := range []struct {
		name string
		res  bpf.SweepResult
		want time.Duration // after start
	}{
		{"a small table", bpf.SweepResult{Due: mono + 30*time.Second, Read: 1000}, 0},
		{"due first", bpf.SweepResult{Due: mono + 30*time.Second, Read: largeTables}, 30 * time.Second},
		{"overdue", bpf.SweepResult{Due: mono - time.Second, Read: largeTables}, -time.Second},
		{"urgent", bpf.SweepResult{Due: mono + 30*time.Second, Read: largeTables, Urgent: true}, 0},
	} {
		if got := nextWalk(start, mono, c.res, largeTables).Sub(start); got != c.want {
			t.Errorf("%s: next walk %v after the last began, want %v", c.name, got, c.want)
		}
	}
}
