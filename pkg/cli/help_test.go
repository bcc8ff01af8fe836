package cli

import (
	"errors"
	"flag"
	"go/parser"
	"go/token"
	iofs "io/fs"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/backends"
)

// helpGroups reads a --help output: each group's title and the flags under it, in order.
func helpGroups(t *testing.T, help string) (titles []string, flags map[string][]string) {
	t.Helper()
	flags = map[string][]string{}
	title := ""
	group := regexp.MustCompile(`^(\S.*) flags:$`)
	name := regexp.MustCompile(`^  -([a-z0-9-]+)`)
	for _, l := range strings.Split(help, "\n") {
		if m := group.FindStringSubmatch(l); m != nil {
			title = m[1]
			titles = append(titles, title)
		} else if m := name.FindStringSubmatch(l); m != nil {
			if title == "" {
				t.Errorf("flag -%s before any group:\n%s", m[1], help)
			}
			flags[title] = append(flags[title], m[1])
		}
	}
	return titles, flags
}

// The agent's --help shows its flags by concern, each with its default, and each backend's own
// flags in a group of their own, titled by the registry.
func TestHelpGroupsFlags(t *testing.T) {
	_, stderr, err := run(t, "--help")
	if !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("--help: %v", err)
	}
	titles, flags := helpGroups(t, stderr)
	want := []string{"configuration", "datapath"}
	for _, b := range backends.All {
		if b.Flags != nil {
			want = append(want, b.Title+" backend")
			fs := flag.NewFlagSet("", flag.ContinueOnError)
			b.Flags(fs)
			var own []string
			fs.VisitAll(func(f *flag.Flag) { own = append(own, f.Name) })
			if !slices.Equal(flags[b.Title+" backend"], own) {
				t.Errorf("%s backend flags %q, want its entry's %q", b.Title, flags[b.Title+" backend"], own)
			}
		}
	}
	want = append(want, "observability")
	if !slices.Equal(titles, want) {
		t.Errorf("groups %q, want %q", titles, want)
	}
	for group, names := range map[string][]string{
		"configuration": {"config", "config-pattern", "config-source", "enable-ipv6", "kubeconfig", "nomasq-all-reserved-ranges", "random-fully", "to-ports"},
		"datapath":      {"backend", "drift-check-interval", "interfaces", "template-generation"},
		"observability": {"logtostderr", "metrics-address", "node-name", "node-status", "node-status-delay", "rule-metrics-limit", "v"},
	} {
		if !slices.Equal(flags[group], names) {
			t.Errorf("%s flags %q, want %q", group, flags[group], names)
		}
	}
	for _, d := range []string{`(default "/etc/config/ip-masq-agent")`, `(default "auto")`, `(default 1s)`, `(default "IP-MASQ-AGENT")`,
		`(default "/sys/fs/bpf")`, `(default 262144)`, `(default ":9743")`} {
		if !strings.Contains(stderr, d) {
			t.Errorf("--help lacks the default %s:\n%s", d, stderr)
		}
	}
	// A flag given before --help does not change the default shown.
	if _, stderr, _ := run(t, "--backend=bpf", "--help"); !strings.Contains(stderr, `(default "auto")`) {
		t.Errorf("--backend=bpf --help shows another default:\n%s", stderr)
	}
}

// Every command's help shows one example, which runs: explain, render and version run it for
// real (the example's configuration file, absent here, means the defaults); the agent, dump
// and cleanup, which would change or read the node, parse its flags (the example then --help).
func TestEveryCommandHasAnExample(t *testing.T) {
	for _, c := range append(commands(), agentCommand) {
		name := c.name
		if name == "" {
			name = "the agent"
		}
		args := strings.Fields(c.example)
		if c.name != "" && (len(args) == 0 || args[0] != c.name) {
			t.Errorf("%s: the example %q does not run it", name, c.example)
			continue
		}
		help := []string{"--help"}
		if c.name != "" {
			help = []string{c.name, "--help"}
		}
		_, stderr, _ := run(t, help...)
		if !strings.Contains(stderr, "\nexample:\n  ip-masq-agent "+c.example+"\n") || !strings.Contains(stderr, c.summary) {
			t.Errorf("%s --help lacks its summary or example:\n%s", name, stderr)
		}
		switch c.name {
		case "explain", "render", "version":
			if out, _, err := run(t, args...); err != nil || out == "" {
				t.Errorf("%s: the example %q: %v\n%s", name, c.example, err, out)
			}
		default:
			if _, stderr, err := run(t, append(args, "--help")...); !errors.Is(err, flag.ErrHelp) {
				t.Errorf("%s: the example's flags %q do not parse: %v\n%s", name, c.example, err, stderr)
			}
		}
	}
}

// The command line names no backend: it takes them all from the registry (package backends),
// so that a backend is its own package and one line of the registry. Neither the packages the
// registry lists nor the engines behind them are imported here.
func TestCLIImportsOnlyTheRegistry(t *testing.T) {
	const module = "github.com/ip-masq-agent/ip-masq-agent/pkg/"
	shared := []string{"agent", "datapath", "policy"}
	imports := func(dir string) []string {
		t.Helper()
		pkgs, err := parser.ParseDir(token.NewFileSet(), dir, func(fi iofs.FileInfo) bool { return !strings.HasSuffix(fi.Name(), "_test.go") }, parser.ImportsOnly)
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, p := range pkgs {
			for _, f := range p.Files {
				for _, imp := range f.Imports {
					path, _ := strconv.Unquote(imp.Path.Value)
					if rest, ok := strings.CutPrefix(path, module); ok && !slices.Contains(shared, rest) && !slices.Contains(out, rest) {
						out = append(out, rest)
					}
				}
			}
		}
		return out
	}
	var behind []string
	for _, b := range imports("../backends") {
		behind = append(behind, b)
		behind = append(behind, imports(filepath.Join("..", b))...)
	}
	if len(behind) < 3 {
		t.Fatalf("the registry imports only %q", behind)
	}
	for _, imp := range imports(".") {
		if slices.Contains(behind, imp) {
			t.Errorf("pkg/cli imports pkg/%s, which is behind the registry", imp)
		}
	}
}
