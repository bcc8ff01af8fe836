package bench

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/test/bench/benchdata"
	"github.com/ip-masq-agent/ip-masq-agent/test/e2e"
)

// conntrackFlows is how many masqueraded UDP flows BenchmarkConntrackMemory opens.
const conntrackFlows = 100_000

// BenchmarkConntrackMemory measures what netfilter conntrack spends per masqueraded connection on
// this kernel: the iptables backend (MASQUERADE) in a test node, conntrackFlows UDP flows from the
// pod, and the kernel's slab caches before and after (pages in use, /proc/slabinfo: every cache,
// so that the NAT extension's kmalloc is counted wherever it lands), -big-runs times, each in a
// topology of its own. The slabs are shared with the rest of the machine: run it on a quiet one.
// Results go to conntrack.json in -out.
//
//	go test -run '^$' -bench ConntrackMemory -benchtime 1x ./test/bench -args -out DIR
func BenchmarkConntrackMemory(b *testing.B) {
	testutil.RequirePrivileged(b, "ip", "iptables-nft-restore")
	bins := buildBinaries(b)
	for range b.N {
		var rounds []benchdata.ConntrackMemory
		for range *bigRuns {
			res := measureConntrack(b, bins)
			rounds = append(rounds, res)
			b.ReportMetric(res.PerConn, "bytes/conn")
		}
		writeJSON(b, benchdata.ConntrackFile, rounds)
	}
}

func measureConntrack(b *testing.B, bins binaries) benchdata.ConntrackMemory {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	env := e2e.NewEnv(ctx, b, bins.agent, nil)
	be := e2e.IptablesBackend(iptables.ModeNFT)
	be.Prepare(ctx, b, env)
	// Unanswered flows outlive the measurement (conntrack gives them 30 s by default).
	if err := e2e.WriteSysctl(env.Node, "net.netfilter.nf_conntrack_udp_timeout", "600"); err != nil {
		b.Fatal(err)
	}
	env.StartReadyNoFile(ctx, b, be)
	res := benchdata.ConntrackMemory{Flows: conntrackFlows, ByCache: map[string]float64{}}
	before := slabs(b)
	if err := e2e.UDPFlows(ctx, env.Pod, e2e.LoadTarget, 2, conntrackFlows); err != nil {
		b.Fatal(err)
	}
	time.Sleep(2 * time.Second) // the last datagrams through the node, the slabs settled
	res.Connections = conntrackCount(b, env.Node, "nf_conntrack_count")
	after := slabs(b)
	if res.Connections < conntrackFlows*9/10 {
		b.Fatalf("%d conntrack entries for %d flows", res.Connections, conntrackFlows)
	}
	var total int64
	for name, a := range after {
		d := a.bytes - before[name].bytes
		if name == "nf_conntrack" || strings.HasPrefix(name, "kmalloc-") {
			total += d
		}
		if per := float64(d) / float64(res.Connections); per > 1 {
			res.ByCache[name] = per
		}
	}
	res.PerConn = float64(total) / float64(res.Connections)
	res.ObjectSize = after["nf_conntrack"].objSize
	res.Buckets = conntrackCount(b, env.Node, "nf_conntrack_buckets")
	res.Max = conntrackCount(b, env.Node, "nf_conntrack_max")
	b.Logf("%d connections: %.0f bytes each in the slabs (%v); nf_conntrack objects of %d bytes, %d buckets, max %d",
		res.Connections, res.PerConn, res.ByCache, res.ObjectSize, res.Buckets, res.Max)
	return res
}

// slab is one slab cache's memory in use (its slabs' pages) and its object size.
type slab struct {
	bytes   int64
	objSize int
}

// slabs reads /proc/slabinfo.
func slabs(b *testing.B) map[string]slab {
	b.Helper()
	f, err := os.Open("/proc/slabinfo")
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	page := int64(os.Getpagesize())
	out := map[string]slab{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// name active_objs num_objs objsize objperslab pagesperslab : tunables ... : slabdata active_slabs num_slabs sharedavail
		fields := strings.Fields(sc.Text())
		if len(fields) < 16 || strings.HasPrefix(fields[0], "#") || fields[0] == "slabinfo" {
			continue
		}
		at := slices.Index(fields, "slabdata")
		if at < 0 || at+2 >= len(fields) {
			continue
		}
		objSize, err1 := strconv.Atoi(fields[3])
		pages, err2 := strconv.ParseInt(fields[5], 10, 64)
		nslabs, err3 := strconv.ParseInt(fields[at+2], 10, 64)
		if err1 != nil || err2 != nil || err3 != nil {
			b.Fatalf("/proc/slabinfo: %q", sc.Text())
		}
		out[fields[0]] = slab{bytes: nslabs * pages * page, objSize: objSize}
	}
	if err := sc.Err(); err != nil {
		b.Fatal(err)
	}
	return out
}

// conntrackCount reads a conntrack sysctl of a namespace.
func conntrackCount(b *testing.B, ns, name string) int {
	b.Helper()
	var n int
	err := testutil.Do(ns, func() error {
		data, err := os.ReadFile("/proc/sys/net/netfilter/" + name)
		if err != nil {
			return err
		}
		n, err = strconv.Atoi(strings.TrimSpace(string(data)))
		return err
	})
	if err != nil {
		b.Fatal(fmt.Errorf("%s: %w", name, err))
	}
	return n
}
