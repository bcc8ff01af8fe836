package backends

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"testing"

	"sigs.k8s.io/knftables"

	"github.com/ip-masq-agent/ip-masq-agent/internal/markdown"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpfbackend"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables/iptablestest"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/nftables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/nftables/nftablestest"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// None of these tests may reach a real datapath: they run in the host's namespace. The BPF
// backend is given a --bpffs that is not a BPF filesystem (so it stops at its first check), the
// iptables and nftables backends fakes.

func TestEveryBackendIsComplete(t *testing.T) {
	seen := map[string]bool{Auto: true}
	for i, b := range All {
		if b.Name == "" || b.Title == "" || b.Installs == "" || b.New == nil || b.Cleanup == nil || b.Read == nil || b.Absent == nil {
			t.Errorf("backend %d (%q) lacks a field: %+v", i, b.Name, b)
		}
		if i < len(All)-1 && b.AutoWhen == "" {
			t.Errorf("backend %s: auto tries it before others, but AutoWhen does not say when auto takes it", b.Name)
		}
		if seen[b.Name] {
			t.Errorf("backend name %q twice", b.Name)
		}
		seen[b.Name] = true
	}
}

func TestNamesAndUsage(t *testing.T) {
	// The two backends the upstream-compatible help text was written for; a third one joins
	// the lists the same way.
	two := []datapath.Entry{bpfbackend.Entry, iptables.Entry}
	if got, want := usage(two), "datapath: auto (BPF when the kernel supports it, else iptables), bpf or iptables"; got != want {
		t.Errorf("usage %q, want %q", got, want)
	}
	if got, want := names(append(two[:1:1], datapath.Entry{Name: "x"}, iptables.Entry)), "bpf, x or iptables"; got != want {
		t.Errorf("names %q, want %q", got, want)
	}
	for _, b := range All {
		if err := CheckName(b.Name); err != nil {
			t.Errorf("CheckName(%q) = %v", b.Name, err)
		}
	}
	if err := CheckName(Auto); err != nil {
		t.Errorf("CheckName(auto) = %v", err)
	}
	if err := CheckName("ebpf"); err == nil || err.Error() != `backend "ebpf": must be auto, `+Names() {
		t.Errorf("CheckName(ebpf) = %v", err)
	}
}

// docs/reference.md's row of the agent's --backend names every backend.
func TestReferenceListsEveryBackend(t *testing.T) {
	doc, err := markdown.Read("docs/reference.md")
	if err != nil {
		t.Fatal(err)
	}
	var row string
	for _, cells := range markdown.Rows(doc) {
		if len(cells) == 4 && cells[0] == "`--backend`" && strings.Contains(cells[2], "agent") {
			row = cells[3]
		}
	}
	if row == "" {
		t.Fatal("docs/reference.md has no --backend row of the agent")
	}
	for _, b := range All {
		if !strings.Contains(row, "`"+b.Name+"`") {
			t.Errorf("docs/reference.md's --backend row does not name %s: %s", b.Name, row)
		}
	}
}

func notBPFFS(t *testing.T) string { return t.TempDir() }

// options are the backends' options on a node whose iptables tools ipt runs, whose nft and
// netlink nft fakes, and whose --bpffs is bpffs.
func options(bpffs string, ipt iptables.Runner, nft *nftables.Options) Options {
	s := Settings{iptables.Name: &iptables.Settings{Runner: ipt}}
	if nft != nil {
		s[nftables.Name] = nft
	}
	if bpffs != "" {
		s[bpfbackend.Name] = &bpfbackend.Settings{BPFFS: bpffs}
	}
	return Options{Settings: s}
}

func nftOptions(f *nftablestest.Fake) *nftables.Options {
	o := f.Options()
	return &o
}

func TestChooseAutoFallsBack(t *testing.T) {
	var logs bytes.Buffer
	f := iptablestest.New()
	o := options(notBPFFS(t), f, nftOptions(nftablestest.New()))
	o.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	c, err := Choose(context.Background(), Auto, o)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if c.Backend.Name() != iptables.Name || c.Changes != nil {
		t.Errorf("chose %s (changes %v), want iptables without events", c.Backend.Name(), c.Changes)
	}
	var displaced []string
	for _, d := range c.Displace {
		displaced = append(displaced, d.Name())
	}
	var want []string
	for _, b := range All {
		if b.Name != iptables.Name {
			want = append(want, b.Name)
		}
	}
	if !slices.Equal(displaced, want) {
		t.Errorf("displaces %q, want every other backend: %q", displaced, want)
	}
	for _, want := range []string{"the BPF datapath cannot run here; using iptables", "is not a BPF filesystem",
		"the nftables datapath does not fit this node; using iptables", "kube-proxy has no nftables table",
		"datapath chosen", "backend=iptables"} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("logs lack %q:\n%s", want, logs.String())
		}
	}
	// The fallback is told, with why: BPF cannot run, nftables merely does not fit.
	if !slices.Equal(c.CannotRun, []string{"bpf"}) || !strings.Contains(c.Reason, "bpf cannot run: ") ||
		!strings.Contains(c.Reason, "nftables does not fit: kube-proxy has no nftables table") {
		t.Errorf("cannot run %q, reason %q", c.CannotRun, c.Reason)
	}
	// Building a backend installs nothing.
	if r := f.Restores(); len(r) != 0 {
		t.Errorf("choosing ran restores %q", r)
	}
}

func TestChooseNamedBackendThatCannotRun(t *testing.T) {
	dir := notBPFFS(t)
	_, err := Choose(context.Background(), "bpf", options(dir, iptablestest.New(), nil))
	if err == nil || !strings.HasPrefix(err.Error(), "backend bpf: --bpffs "+dir+" is not a BPF filesystem") {
		t.Errorf("err = %v", err)
	}
	f := iptablestest.New()
	f.Installed = map[string]bool{}
	noNFT := nftablestest.New().Options()
	noNFT.NFT = func(policy.Family) (knftables.Interface, error) {
		return nil, errors.New("could not find nftables binary")
	}
	_, err = Choose(context.Background(), Auto, options(dir, f, &noNFT))
	if err == nil || !strings.Contains(err.Error(), "backend iptables: no iptables tools found") {
		t.Errorf("auto where nothing can run: err = %v", err)
	}
	if _, err := Choose(context.Background(), "ebpf", Options{}); err == nil || !strings.Contains(err.Error(), "must be auto, "+Names()) {
		t.Errorf("unknown backend: err = %v", err)
	}
}

func installedPolicy(t *testing.T) *policy.Policy {
	t.Helper()
	return policy.Compile(config.Default(config.Options{}), policy.Options{RandomFully: true})
}

// The iptables backend, displaced (by the BPF one) or cleaned up, removes its chain in every
// mode; a node without any iptables tools has nothing to remove, which is no error.
func TestIptablesCleanup(t *testing.T) {
	ctx := context.Background()
	f := iptablestest.New()
	b, err := iptables.New(ctx, iptables.Options{Runner: f, Chain: "MY-CHAIN"})
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Apply(ctx, installedPolicy(t)); err != nil {
		t.Fatal(err)
	}
	o := options(notBPFFS(t), nil, nil)
	o.Settings[iptables.Name] = &iptables.Settings{Runner: f, Chain: "MY-CHAIN"}
	for _, d := range others("bpf", o) {
		if d.Name() != iptables.Name {
			continue // only the iptables backend has a fake here
		}
		if err := d.Cleanup(ctx); err != nil {
			t.Fatalf("displace %s: %v", d.Name(), err)
		}
	}
	if f.NAT(iptables.ModeNFT, policy.IPv4).Has("MY-CHAIN") {
		t.Error("the displaced iptables backend left its chain")
	}
	removed, err := iptables.Entry.Cleanup(ctx, o.env(iptables.Entry))
	if err != nil || removed != "chain MY-CHAIN and its jumps are gone (IPv4 and IPv6, iptables-nft and iptables-legacy)" {
		t.Errorf("cleanup: %q, %v", removed, err)
	}

	f.Installed = map[string]bool{}
	removed, err = iptables.Entry.Cleanup(ctx, o.env(iptables.Entry))
	if err != nil || !strings.HasPrefix(removed, "no tools, so no chain to remove (") || strings.Contains(removed, "\n") {
		t.Errorf("cleanup without tools: %q, %v", removed, err)
	}
}

func TestInstalled(t *testing.T) {
	ctx := context.Background()
	f := iptablestest.New()
	o := options(t.TempDir(), f, nftOptions(nftablestest.New()))
	readers, absent, err := Installed(ctx, o, nil)
	if err != nil || len(readers) != 0 {
		t.Fatalf("nothing installed: %v, %v", readers, err)
	}
	if len(absent) != len(All) || !slices.Contains(absent, "nothing pinned under "+o.Settings[bpfbackend.Name].(*bpfbackend.Settings).BPFFS+"/ip-masq-agent") ||
		!slices.Contains(absent, "no IP-MASQ-AGENT chain in iptables-nft or iptables-legacy") {
		t.Errorf("absent %q, want where each backend looked", absent)
	}
	b, err := iptables.New(ctx, iptables.Options{Runner: f})
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Apply(ctx, installedPolicy(t)); err != nil {
		t.Fatal(err)
	}
	readers, absent, err = Installed(ctx, o, nil)
	if err != nil || len(readers) != 1 || readers[0].Info().Backend != iptables.Name || absent != nil {
		t.Errorf("one chain installed: %v, %q, %v", readers, absent, err)
	}
}

// Auto takes nftables where kube-proxy keeps an nftables table, or where the node has no
// iptables at all; it displaces the others and installs nothing by choosing.
func TestChooseAutoTakesNftables(t *testing.T) {
	for _, tt := range []struct {
		name      string
		kubeProxy bool
		iptables  bool
	}{{"kube-proxy in nftables mode", true, true}, {"no iptables", false, false}} {
		t.Run(tt.name, func(t *testing.T) {
			var logs bytes.Buffer
			f := iptablestest.New()
			if !tt.iptables {
				f.Installed = map[string]bool{}
			}
			nft := nftablestest.New()
			if tt.kubeProxy {
				nft.Others = map[policy.Family][]string{policy.IPv6: {nftables.KubeProxyTable}}
			}
			o := options(notBPFFS(t), f, nftOptions(nft))
			o.Logger = slog.New(slog.NewTextHandler(&logs, nil))
			c, err := Choose(context.Background(), Auto, o)
			if err != nil {
				t.Fatal(err)
			}
			if c.Backend.Name() != nftables.Name {
				t.Fatalf("chose %s, want nftables\n%s", c.Backend.Name(), logs.String())
			}
			var displaced []string
			for _, d := range c.Displace {
				displaced = append(displaced, d.Name())
			}
			// Every other backend of the registry, in its order.
			var others []string
			for _, b := range All {
				if b.Name != nftables.Name {
					others = append(others, b.Name)
				}
			}
			if !slices.Equal(displaced, others) {
				t.Errorf("displaces %q, want %q", displaced, others)
			}
			want := []string{`level=WARN msg="the BPF datapath cannot run here; using nftables"`}
			if !tt.iptables {
				// nftables does not fit, but auto comes back to it: iptables cannot run either.
				want = append(want, `level=INFO msg="the iptables datapath cannot run here; using nftables"`,
					`level=INFO msg="the nftables datapath does not fit this node, but no backend that fits can run: using it" component=backends reason="kube-proxy has no nftables table"`)
			}
			for _, w := range want {
				if !strings.Contains(logs.String(), w) {
					t.Errorf("logs lack %s:\n%s", w, logs.String())
				}
			}
			if len(nft.Runs) != 0 || nft.Table(policy.IPv4) != nil {
				t.Errorf("choosing ran transactions: %v", nft.Runs)
			}
		})
	}
}

// The nftables backend, displaced or cleaned up, removes both tables; where there is none, it
// needs no nft; where there is one and nft cannot run, that is an error.
func TestNftablesCleanup(t *testing.T) {
	ctx := context.Background()
	nft := nftablestest.New()
	b, err := nftables.New(ctx, nft.Options())
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Apply(ctx, policy.Compile(config.Default(config.Options{}), policy.Options{EnableIPv6: true})); err != nil {
		t.Fatal(err)
	}
	o := options("", nil, nftOptions(nft))
	removed, err := nftables.Entry.Cleanup(ctx, o.env(nftables.Entry))
	if err != nil || removed != "table ip-masq-agent removed from ip and ip6" {
		t.Errorf("cleanup: %q, %v", removed, err)
	}
	if nft.Table(policy.IPv4) != nil || nft.Table(policy.IPv6) != nil {
		t.Error("cleanup left a table")
	}
	noNFTOpts := nft.Options()
	noNFTOpts.NFT = func(policy.Family) (knftables.Interface, error) {
		return nil, errors.New("could not find nftables binary")
	}
	noNFT := options("", nil, &noNFTOpts)
	removed, err = nftables.Entry.Cleanup(ctx, noNFT.env(nftables.Entry))
	if err != nil || removed != "no ip-masq-agent table in nftables" {
		t.Errorf("cleanup of nothing without nft: %q, %v", removed, err)
	}
	if err := b.Apply(ctx, policy.Compile(config.Default(config.Options{}), policy.Options{})); err != nil {
		t.Fatal(err)
	}
	if _, err := nftables.Entry.Cleanup(ctx, noNFT.env(nftables.Entry)); err == nil || !strings.Contains(err.Error(), "could not find nftables binary") {
		t.Errorf("cleanup of a table without nft: %v", err)
	}
}
