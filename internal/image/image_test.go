package image

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// instructions reads a Dockerfile's stages: each instruction with its continuation lines
// joined, comments dropped.
func instructions(t *testing.T, path string) [][]string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var stages [][]string
	var cur strings.Builder
	for _, line := range strings.Split(string(data), "\n") {
		trimmed := strings.TrimSpace(line)
		if strings.HasPrefix(trimmed, "#") || (trimmed == "" && cur.Len() == 0) {
			continue
		}
		cont := strings.HasSuffix(trimmed, "\\")
		cur.WriteString(strings.TrimSuffix(trimmed, "\\") + " ")
		if cont {
			continue
		}
		ins := strings.TrimSpace(cur.String())
		cur.Reset()
		if strings.HasPrefix(ins, "FROM ") {
			stages = append(stages, nil)
		}
		if len(stages) == 0 {
			t.Fatalf("%s: %q before FROM", path, ins)
		}
		stages[len(stages)-1] = append(stages[len(stages)-1], ins)
	}
	return stages
}

// The Dockerfile's final stage is the image that Build makes: the same Debian suite, the same
// packages, the same removals, the binary at the same path, the same user and entrypoint. (Its
// base, -slim, is Debian's minimal set with apt; Build's is the smaller essential set.)
func TestDockerfileDescribesTheImage(t *testing.T) {
	stages := instructions(t, filepath.Join("..", "..", "Dockerfile"))
	final := stages[len(stages)-1]
	var packages, removed []string
	var binary, user string
	var entrypoint []string
	for _, ins := range final {
		verb, rest, _ := strings.Cut(ins, " ")
		switch verb {
		case "FROM":
			if want := "debian:" + Runtime.Suite + "-slim"; rest != want {
				t.Errorf("FROM %s, want %s", rest, want)
			}
		case "RUN":
			for _, cmd := range strings.Split(rest, "&&") {
				f := strings.Fields(cmd)
				if i := slices.Index(f, "install"); i >= 0 && slices.Contains(f, "apt-get") {
					for _, a := range f[i+1:] {
						if !strings.HasPrefix(a, "-") {
							packages = append(packages, a)
						}
					}
				}
				if len(f) > 2 && f[0] == "rm" && f[1] == "-rf" {
					for _, p := range f[2:] {
						// apt's lists: Build's root filesystem never has them (mmdebstrap
						// removes them).
						if p != "/var/lib/apt/lists/*" {
							removed = append(removed, p)
						}
					}
				}
			}
		case "COPY":
			f := strings.Fields(rest)
			binary = f[len(f)-1]
		case "USER":
			user = rest
		case "ENTRYPOINT":
			if err := json.Unmarshal([]byte(rest), &entrypoint); err != nil {
				t.Fatalf("ENTRYPOINT %s: %v", rest, err)
			}
		default:
			t.Errorf("the final stage has %s, which Build does not do", verb)
		}
	}
	slices.Sort(removed)
	want := slices.Sorted(slices.Values(Runtime.Remove))
	for _, c := range []struct {
		what      string
		got, want []string
	}{
		{"packages", packages, Runtime.Packages},
		{"removed", removed, want},
		{"binary", []string{binary}, []string{Runtime.Binary}},
		{"user", []string{user}, []string{Runtime.User}},
		{"entrypoint", entrypoint, []string{Runtime.Binary}},
	} {
		if !slices.Equal(c.got, c.want) {
			t.Errorf("%s: the Dockerfile has %q, the image %q", c.what, c.got, c.want)
		}
	}
}

func TestSourcesOf(t *testing.T) {
	indextargets := `http://deb.example/debian bookworm main
http://deb.example/debian bookworm contrib
http://deb.example/debian bookworm main
http://deb.example/debian bookworm-updates main
http://security.example/debian-security bookworm-security main
http://deb.example/debian trixie main
https://vendor.example/apt cloud-sdk-bookworm main
`
	got, err := sourcesOf(indextargets, "bookworm")
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		"deb http://deb.example/debian bookworm contrib main",
		"deb http://deb.example/debian bookworm-updates main",
		"deb http://security.example/debian-security bookworm-security main",
	}
	if !slices.Equal(got, want) {
		t.Errorf("sources:\n %q\nwant\n %q", got, want)
	}
	if _, err := sourcesOf("http://deb.example/debian trixie main\n", "bookworm"); err == nil || !strings.Contains(err.Error(), "no apt source of Debian bookworm") {
		t.Errorf("without the suite: %v", err)
	}
}
