package cli

import (
	"flag"
	"go/parser"
	"go/token"
	iofs "io/fs"
	"maps"
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

// helpOf runs `ip-masq-agent NAME --help` (the agent's for "") and returns its help: on stdout,
// and no error.
func helpOf(t *testing.T, name string) string {
	t.Helper()
	args := []string{"--help"}
	if name != "" {
		args = []string{name, "--help"}
	}
	stdout, stderr, err := run(t, args...)
	if err != nil || stderr != "" || stdout == "" {
		t.Fatalf("%q: %v, stderr %q, stdout %q", args, err, stderr, stdout)
	}
	return stdout
}

// Every command, the agent's too, follows the conventions of help: --help, -h and
// `help COMMAND` print the same help to stdout, with no error (exit 0); a mistake on the
// command line prints the command's usage line to stderr and returns the error, which main
// prints once (exit 2).
func TestHelpConventions(t *testing.T) {
	for _, c := range append(commands(), agentCommand) {
		name, invoke := c.name, []string{c.name}
		if name == "" {
			name, invoke = "agent", nil
		}
		t.Run(name, func(t *testing.T) {
			usage := strings.TrimSpace("usage: ip-masq-agent "+c.name) + " " + c.args + "\n"
			var first string
			for _, args := range [][]string{append(invoke, "--help"), append(invoke, "-h"), {"help", name}} {
				stdout, stderr, err := run(t, args...)
				if err != nil || stderr != "" {
					t.Errorf("%q: %v, stderr %q; want no error, nothing on stderr", args, err, stderr)
				}
				if !strings.HasPrefix(stdout, usage) || !strings.Contains(stdout, "\nexample:\n  ip-masq-agent "+c.example+"\n") {
					t.Errorf("%q printed %q, want the help, starting %q", args, stdout, usage)
				}
				if first == "" {
					first = stdout
				} else if stdout != first {
					t.Errorf("%q printed another help than %q:\n%s", args, invoke, stdout)
				}
			}

			args := append(invoke, "--no-such-flag")
			stdout, stderr, err := run(t, args...)
			const want = "flag provided but not defined: -no-such-flag"
			if err == nil || err.Error() != want || ExitCode(err) != 2 {
				t.Errorf("%q: %v (exit %d), want %q (exit 2)", args, err, ExitCode(err), want)
			}
			short := usage + "run '" + strings.TrimSpace("ip-masq-agent "+c.name) + " --help' for its flags, and an example\n"
			if stdout != "" || stderr != short {
				t.Errorf("%q: stdout %q, stderr %q; want the usage line alone on stderr, %q (the error is main's to print, once)", args, stdout, stderr, short)
			}
		})
	}
	// help itself: alone, the commands; of no such command, its usage and the error.
	if stdout, stderr, err := run(t, "help"); err != nil || stderr != "" || !strings.Contains(stdout, "ip-masq-agent explain ") {
		t.Errorf("help: %v, stderr %q, stdout %q", err, stderr, stdout)
	}
	stdout, stderr, err := run(t, "help", "frobnicate")
	if err == nil || !strings.Contains(err.Error(), `unknown command "frobnicate"`) || ExitCode(err) != 2 || stdout != "" ||
		!strings.HasPrefix(stderr, "usage: ip-masq-agent help [COMMAND]\n") || strings.Contains(stderr, "frobnicate") {
		t.Errorf("help frobnicate: %v (exit %d), stdout %q, stderr %q", err, ExitCode(err), stdout, stderr)
	}
}

// The agent's --help shows its flags by concern, each with its default, and each backend's own
// flags in a group of their own, titled by the registry.
func TestHelpGroupsFlags(t *testing.T) {
	stderr := helpOf(t, "")
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
		"observability": {"logtostderr", "metrics-address", "metrics-cert-file", "metrics-key-file", "metrics-secure", "node-name", "node-status", "node-status-delay", "node-status-heartbeat", "rule-metrics-limit", "v"},
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
	if stderr, _, _ := run(t, "--backend=bpf", "--help"); !strings.Contains(stderr, `(default "auto")`) {
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
		stderr := helpOf(t, c.name)
		if !strings.Contains(stderr, "\nexample:\n  ip-masq-agent "+c.example+"\n") || !strings.Contains(stderr, c.summary) {
			t.Errorf("%s --help lacks its summary or example:\n%s", name, stderr)
		}
		switch c.name {
		case "explain", "render", "version":
			if out, _, err := run(t, args...); err != nil || out == "" {
				t.Errorf("%s: the example %q: %v\n%s", name, c.example, err, out)
			}
		default:
			if stdout, stderr, err := run(t, append(args, "--help")...); err != nil || stdout == "" {
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
	// The configuration and the policy are every backend's input, not a backend's engine.
	shared := []string{"agent", "config", "datapath", "policy"}
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

// dump and cleanup take every flag of the agent, so that the DaemonSet's arguments can be reused:
// their help lists each one they read, and names the others as accepted.
func TestDumpAndCleanupAcceptTheAgentsFlags(t *testing.T) {
	_, agentFlags := helpGroups(t, helpOf(t, ""))
	for _, name := range []string{"dump", "cleanup"} {
		help := helpOf(t, name)
		_, listed := helpGroups(t, help)
		_, accepted, _ := strings.Cut(help, "accepted and not read, so that the agent's arguments can be reused: ")
		for _, names := range agentFlags {
			for _, f := range names {
				inList := slices.ContainsFunc(slices.Collect(maps.Values(listed)), func(ns []string) bool { return slices.Contains(ns, f) })
				inAccepted := slices.Contains(strings.Split(strings.TrimSpace(accepted), ", "), "--"+f)
				if inList == inAccepted {
					t.Errorf("%s --help: the agent's --%s listed %v, named as accepted %v; want one of them", name, f, inList, inAccepted)
				}
			}
		}
	}
}
